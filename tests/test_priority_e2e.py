"""Request priorities end to end, all real processes and the ``openai`` client: vLLM's
``priority`` body field and the ``x-dynamo-priority`` header (which wins) order the kv router's
wait queue (priority, then deadline from ``x-dynamo-request-timeout``, then arrival; a deadline
that passes in the queue is a 504) and a mocker's waiting queue under ``--scheduling-policy
priority``; bad values get 400 in OpenAI's error shape.

The order is observed as the order of first tokens where exactly one request runs at a time
(one worker, busy while any request runs, or one running slot): a queued request cannot start
before the one ahead of it has ended, and its own prefill (``--prefill-ms-per-token``) then
takes hundreds of milliseconds, so the order shown is the scheduler's, not a race.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pytest
from openai import OpenAI

from dynamo_zmq.frontend._disagg import prefill_request
from dynamo_zmq.frontend._subrequests import completion_prompts, fan_out
from dynamo_zmq.frontend.preprocess import Preprocessor
from dynamo_zmq.frontend.protocol import parse_chat, parse_completion
from dynamo_zmq.llm import build_card
from dynamo_zmq.llm._migration import continuation
from tests.support.metrics import first_sample, metrics_page
from tests.support.mocker_fleet import mocker_fleet
from tests.support.procs import system_port
from tests.support.waiting import eventually

BLOCK = 16
PROMPT_BLOCKS = 20  # one request's prompt alone holds more than half the cache: busy at 0.5
# At a quarter of the modeled speed: a decode step takes ~0.1 s, a prompt's prefill ~0.3 s.
SPEED = "0.25"
SLOW = ("--block-size", str(BLOCK), "--num-gpu-blocks-override", "32",
        "--prefill-ms-per-token", "0.25")
T = TypeVar("T")
_THREADS = ThreadPoolExecutor(16, thread_name_prefix="priority-stream")
#: The first request's output: it runs for ~10 s, while the others queue behind it.
LONG = 80


def stream_first_token(url: str, prompt: list[int], max_tokens: int, priority: int | None = None,
                       headers: dict[str, str] | None = None) -> float:
    """Stream a completion through the ``openai`` client (``ignore_eos``); returns when its
    first token arrived (``time.monotonic()``), once the stream has ended."""
    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    body: dict[str, Any] = {"ignore_eos": True}
    if priority is not None:
        body["priority"] = priority
    first = None
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                       stream=True, extra_body=body, extra_headers=headers)
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.monotonic()
    assert first is not None
    return first


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a thread of its own (the loop's default pool has only a few threads,
    and the test's own ``/metrics`` reads need one while every stream holds one)."""
    return await asyncio.get_running_loop().run_in_executor(_THREADS, fn, *args)


def prompts(seed: int) -> Any:
    rng = random.Random(seed)
    while True:  # distinct prompts: no prefix is shared
        yield [rng.randrange(10, 500) for _ in range(PROMPT_BLOCKS * BLOCK)]


async def test_the_routers_wait_queue_serves_priority_then_deadline_then_arrival(
        namespace, spawn, tiny_model) -> None:
    fleet = await mocker_fleet(
        spawn, namespace, tiny_model, 1, speedup=SPEED, worker_args=SLOW,
        frontend_args=("--busy-kv-threshold", "0.5", "--busy-queue-size", "8",
                       "--busy-queue-timeout", "90"))
    url, (worker,) = fleet.url, fleet.ids

    async def metric(name: str) -> float | None:
        return first_sample(await metrics_page(url), name, model="tiny")

    async def reported() -> bool:  # the worker's cache size is known: it can be busy
        page = await metrics_page(url)
        return first_sample(page, "dynamo_router_reported_active_blocks", worker=worker) is not None

    await eventually(reported, 30, "the worker reporting its load")
    prompt = prompts(35)
    blocker = asyncio.create_task(in_thread(stream_first_token, url, next(prompt), LONG))
    await eventually(lambda: _equals(metric("dynamo_router_decisions_total"), 1), 30,
                     "the first request routed")

    # Queued one by one (each seen waiting before the next is sent: a defined arrival order).
    # (name, body priority, headers); "urgent"'s header priority overrides its body's.
    queued: list[tuple[str, int | None, dict[str, str]]] = [
        ("low", 5, {}),
        ("plain", None, {}),
        ("deadline-60", None, {"x-dynamo-request-timeout": "60"}),
        ("deadline-30", 0, {"x-dynamo-request-timeout": "30"}),
        ("urgent", 9, {"x-dynamo-priority": "-3"}),
        ("one", 1, {}),
    ]
    tasks = {}
    for i, (name, priority, headers) in enumerate(queued):
        tasks[name] = asyncio.create_task(in_thread(
            stream_first_token, url, next(prompt), 2, priority, headers))
        await eventually(lambda n=i + 1: _equals(metric("dynamo_router_busy_queued_requests"), n),
                         30, f"{i + 1} requests waiting")
    # A waiting request whose deadline passes leaves the queue with its 504.
    status, reply = await in_thread(_post, url, "/v1/completions", {
        "model": "tiny", "prompt": next(prompt), "max_tokens": 2,
    }, {"x-dynamo-request-timeout": "1"})
    assert status == 504 and reply["error"]["code"] == "timeout", reply
    assert await metric("dynamo_router_busy_queued_requests") == len(queued)
    assert not blocker.done()  # all of them queued while the first one ran
    firsts = dict(zip(tasks, await asyncio.wait_for(asyncio.gather(*tasks.values()), 120),
                      strict=True))
    await asyncio.wait_for(blocker, 30)
    assert sorted(firsts, key=firsts.__getitem__) == [
        "urgent", "deadline-30", "deadline-60", "plain", "one", "low"]
    assert await metric("dynamo_router_busy_queued_requests") == 0
    assert not await metric("dynamo_router_busy_rejected_total")


async def test_a_priority_mocker_starts_queued_requests_by_the_requests_priority(
        namespace, spawn, tiny_model) -> None:
    """The priority travels to the engine: one running slot, ``--scheduling-policy priority``,
    no router queue (round-robin)."""
    fleet = await mocker_fleet(
        spawn, namespace, tiny_model, 1, mode="round-robin", speedup=SPEED,
        worker_args=(*SLOW, "--max-num-seqs", "1", "--scheduling-policy", "priority",
                     "--metrics-port", "0"))
    url = fleet.url
    worker_metrics = f"http://127.0.0.1:{system_port(fleet.workers[0])}"

    async def waiting(n: int) -> bool:
        page = await metrics_page(worker_metrics)
        return first_sample(page, "dynamo_component_waiting_requests") == n

    prompt = prompts(36)
    blocker = asyncio.create_task(in_thread(stream_first_token, url, next(prompt), LONG))
    async def running() -> bool:  # the first request holds KV blocks: it runs
        page = await metrics_page(worker_metrics)
        return bool(first_sample(page, "dynamo_component_kvstats_active_blocks"))

    await eventually(running, 30, "the first request running")
    queued: list[tuple[str, int | None, dict[str, str]]] = [
        ("plain", None, {}), ("low", 4, {}), ("urgent", 2, {"x-dynamo-priority": "-1"}),
        ("high", -1, {}), ("one", 1, {}),
    ]
    tasks = {}
    for i, (name, priority, headers) in enumerate(queued):
        tasks[name] = asyncio.create_task(in_thread(
            stream_first_token, url, next(prompt), 2, priority, headers))
        await eventually(lambda n=i + 1: waiting(n), 30, f"{i + 1} requests waiting")
    assert not blocker.done()
    firsts = dict(zip(tasks, await asyncio.wait_for(asyncio.gather(*tasks.values()), 120),
                      strict=True))
    await asyncio.wait_for(blocker, 30)
    # Ties (priority -1: "urgent" by its header, "high" by its body) go by arrival.
    assert sorted(firsts, key=firsts.__getitem__) == ["urgent", "high", "plain", "one", "low"]


def _post(url: str, path: str, body: dict[str, Any],
          headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
    try:
        conn.request("POST", path, json.dumps(body),
                     {"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


BAD_HEADERS = ["high", "1.5", "", "1_0", "0x10", str(2**63), str(-(2**63) - 1)]
BAD_BODIES: list[Any] = [1.5, "1", True, None, 2**63, [1]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_bad_priorities_are_400_in_openais_shape_and_good_ones_serve(
        namespace, spawn, tiny_model, path) -> None:
    fleet = await mocker_fleet(spawn, namespace, tiny_model, 1)
    url = fleet.url
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 2}
    if path == "/v1/completions":
        body["prompt"] = "hello"
    else:
        body["messages"] = [{"role": "user", "content": "hello"}]

    def check(status: int, reply: dict[str, Any], param: str | None) -> None:
        assert status == 400, reply
        err = reply["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "invalid_request_error" and err["param"] == param
        assert "priority" in err["message"]

    for value in BAD_HEADERS:
        status, reply = await asyncio.to_thread(_post, url, path, body,
                                                {"x-dynamo-priority": value})
        check(status, reply, None)
        assert reply["error"]["code"] == "invalid_value"
    for bad in BAD_BODIES:
        status, reply = await asyncio.to_thread(_post, url, path, {**body, "priority": bad}, {})
        check(status, reply, "priority")
    # A bad body value is refused even when a good header would override it.
    status, reply = await asyncio.to_thread(_post, url, path, {**body, "priority": "x"},
                                            {"x-dynamo-priority": "1"})
    check(status, reply, "priority")
    for value, headers in ((-(2**63), {}), (2**63 - 1, {}), (7, {"x-dynamo-priority": " -7 "})):
        status, reply = await asyncio.to_thread(_post, url, path, {**body, "priority": value},
                                                headers)
        assert status == 200, reply


async def _equals(value: Any, expected: float) -> bool:
    return await value == expected


def test_every_request_a_priority_makes_carries_it(tiny_model) -> None:
    """The preprocessor sets ``PreprocessedRequest.priority``; every sub-request of a batch
    with ``n``, a migrated continuation and a disaggregated prefill keep it."""
    pre = Preprocessor(tiny_model, build_card(tiny_model, "tiny"))
    chat = pre.chat(parse_chat(json.dumps({
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "priority": -2,
    }).encode()))
    assert chat.priority == -2
    req = parse_completion(json.dumps({
        "model": "tiny", "prompt": ["a", "b"], "n": 2, "max_tokens": 4, "priority": 6,
    }).encode())
    subs = fan_out(completion_prompts(pre, req), 2, 2)
    assert len(subs) == 4 and {s.pre.priority for s in subs} == {6}
    moved = continuation(subs[0].pre, [5, 6])
    assert moved is not None and moved.priority == 6
    assert prefill_request(subs[0].pre).priority == 6
    default = pre.completion(parse_completion(b'{"model": "tiny", "prompt": "a"}'))
    assert default.priority == 0
