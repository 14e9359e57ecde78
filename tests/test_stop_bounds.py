"""Stop strings are bounded (issue 20, item 2): the frontend answers 400 beyond the bounds, a stop
string at the bound is served and matched, and a worker refuses an oversized one sent by a
runtime-API caller with InvalidArgument and keeps serving. The echo engine streams the prompt
back, so the stop string is known to occur in the output."""

from __future__ import annotations

import asyncio
import json

import pytest

from dynamo_zmq import errors
from dynamo_zmq.llm import MAX_STOP_LENGTH, MAX_STOP_STRINGS
from tests.support.http_calls import post
from tests.support.mocker_fleet import ECHO, start_frontend, start_worker
from tests.support.waiting import wait_models


@pytest.fixture
async def echo(namespace, spawn, tiny_model):
    """An echo worker and a frontend; yields (worker proc, frontend url)."""
    proc = start_worker(spawn, namespace, tiny_model, model="echo", engine=ECHO, ready=True)
    url = start_frontend(spawn, namespace, mode=None, ready=True).address
    await wait_models(url, {"echo"})
    return proc, url


def completion(url: str, prompt: str, stop: object, max_tokens: int = 8) -> tuple[int, dict]:
    body = json.dumps({"model": "echo", "prompt": prompt, "max_tokens": max_tokens, "stop": stop})
    status, raw = post(f"{url}/v1/completions", body.encode())
    return status, json.loads(raw)


@pytest.mark.parametrize(
    "stop",
    [
        "A" * 40_000,
        ["x", "B" * (MAX_STOP_LENGTH + 1)],
        [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)],
    ],
    ids=["40k-chars", "one-over-the-length", "one-string-too-many"],
)
async def test_oversized_stops_are_a_400_naming_stop(echo, stop):
    _, url = echo
    status, body = await asyncio.to_thread(completion, url, "hello", stop)
    assert status == 400, body
    error = body["error"]
    assert error["param"] == "stop" and error["type"] == "invalid_request_error"
    assert "stop" in error["message"]
    # ...and the frontend and worker still serve.
    status, body = await asyncio.to_thread(completion, url, "hello", None, 2)
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body


async def test_a_stop_string_at_the_bound_is_served_and_matched(echo):
    _, url = echo
    stop = ("hello world " * (MAX_STOP_LENGTH // 12 + 1))[:MAX_STOP_LENGTH]
    stops = [f"never{i}" for i in range(MAX_STOP_STRINGS - 1)] + [stop]
    status, body = await asyncio.to_thread(
        completion, url, f"start {stop} end", stops, 1900
    )
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop", choice["finish_reason"]
    assert choice["text"].strip() == "start"


async def test_a_worker_refuses_an_oversized_stop_from_a_runtime_caller(
    echo, namespace, make_runtime
):
    proc, _ = echo
    client = await (
        make_runtime(static=(proc.address,)).endpoint(f"{namespace}.backend.generate").client()
    )
    await client.wait_for_instances(timeout=15)

    async def run(stop: list[str]) -> list[dict]:
        req = {"token_ids": [5, 6, 7], "stop": {"max_tokens": 2, "stop": stop}}
        return [r.data() async for r in await client.generate(req)]

    with pytest.raises(errors.InvalidArgument) as exc:
        await run(["A" * 1_000_000])
    assert "stop" in exc.value.message and str(MAX_STOP_LENGTH) in exc.value.message
    with pytest.raises(errors.InvalidArgument):
        await run(["x"] * (MAX_STOP_STRINGS + 1))
    assert (await run(["zzz"]))[-1]["finish_reason"] == "length"
