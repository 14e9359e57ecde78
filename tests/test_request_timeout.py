"""The whole-request deadline (``--request-timeout``, ``x-dynamo-request-timeout``): 504 in
OpenAI's error shape, an SSE error event once a stream has started, and the worker's context
stopped; separate from ``--idle-timeout``, the wait for each next output.

The mocker runs slowly here (``--speedup-ratio 0.1``: about 60 ms a token), so a long request
outlives any deadline below and a short one finishes well within it.
"""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.support.http_calls import get
from tests.support.metrics import sample
from tests.support.mocker_fleet import Fleet, mocker_fleet
from tests.support.procs import Proc, system_port

SLOW = "0.1"
MESSAGES = [{"role": "user", "content": "Tell me a long story"}]
#: Tokens that take far longer than any deadline here (about 20 s), yet end a run of the old
#: code (no whole-request deadline) within the client's timeout, so it fails instead of hangs.
LONG = 300


async def slow_fleet(spawn, namespace, model_dir, *frontend_args: str) -> Fleet:
    """A slow mocker worker (with a metrics port) and a round-robin frontend listing it."""
    return await mocker_fleet(spawn, namespace, model_dir, 1, mode=None, speedup=SLOW,
                              worker_args=("--metrics-port", "0"), frontend_args=frontend_args)


def client_for(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


async def worker_saw_the_stop(proc: Proc) -> None:
    """The worker counted a cancellation (its context was stopped) and holds no request."""
    port = system_port(proc)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 15
    while True:
        _, body = await asyncio.to_thread(get, f"http://127.0.0.1:{port}/metrics")
        text = body.decode()
        cancelled = sample(text, "dynamo_component_cancellation_total", model="tiny")
        inflight = sample(text, "dynamo_component_inflight_requests", model="tiny")
        if cancelled is not None and cancelled >= 1 and inflight == 0:
            return
        assert loop.time() < deadline, f"the worker never saw the request stopped:\n{text}"
        await asyncio.sleep(0.1)


@pytest.fixture
async def deadline_4s(namespace, spawn, tiny_model):
    """A slow worker and a frontend whose requests may take 4 s, with 1 s between outputs."""
    fleet = await slow_fleet(spawn, namespace, tiny_model, "--request-timeout", "4",
                             "--idle-timeout", "1")
    (proc,), url = fleet.workers, fleet.url
    async with client_for(url) as client:
        yield proc, client


async def test_a_request_past_its_deadline_gets_504_and_stops_the_worker(deadline_4s):
    proc, client = deadline_4s
    with pytest.raises(openai.APIStatusError) as exc:
        await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=LONG)
    assert exc.value.status_code == 504
    assert exc.value.body["type"] == "timeout_error" and exc.value.body["code"] == "timeout"
    assert "4 s deadline" in exc.value.body["message"]
    await worker_saw_the_stop(proc)


async def test_the_deadline_is_not_the_idle_timeout(deadline_4s):
    """A request that streams steadily for longer than the idle timeout (1 s) but within its
    deadline (4 s) completes."""
    _, client = deadline_4s
    resp = await client.completions.create(model="tiny", prompt="Once", max_tokens=30)
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 30


async def test_a_deadline_mid_stream_ends_it_with_an_error_event(deadline_4s):
    """The stream started (200 and chunks went out): the deadline arrives as an SSE error event
    in OpenAI's error shape, which the openai client raises as ``APIError``."""
    proc, client = deadline_4s
    stream = await client.completions.create(
        model="tiny", prompt="Once", max_tokens=LONG, stream=True
    )
    texts = []
    with pytest.raises(openai.APIError) as exc:
        async for chunk in stream:
            texts.append(chunk.choices[0].text)
    assert texts, "the deadline should come after the first chunks"
    assert exc.value.body["code"] == "timeout" and exc.value.body["type"] == "timeout_error"
    await worker_saw_the_stop(proc)


async def test_a_request_header_sets_the_runtime_deadline(namespace, spawn, tiny_model):
    """Without --request-timeout there is no deadline; ``x-dynamo-request-timeout`` gives one
    request its own (it travels as the runtime's per-request timeout too)."""
    fleet = await slow_fleet(spawn, namespace, tiny_model)
    (proc,), url = fleet.workers, fleet.url
    async with client_for(url) as client:
        with pytest.raises(openai.APIStatusError) as exc:
            await client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=LONG,
                extra_headers={"x-dynamo-request-timeout": "1.5"},
            )
        assert exc.value.status_code == 504 and "1.5 s deadline" in exc.value.body["message"]
        await worker_saw_the_stop(proc)
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=2,
                extra_headers={"x-dynamo-request-timeout": "soon"},
            )
        resp = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
        assert resp.choices[0].finish_reason == "length"
