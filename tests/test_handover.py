"""Graceful hand-over on SIGTERM (issue 14, item 4), on real mocker workers: requests that finish
within ``--graceful-timeout`` complete; those still running then end with a retryable
``EngineShutdown`` ("handed over") after their outputs, never ``cancelled`` and never a socket
that just closes; requests sent once the worker is leaving are served by another worker.

The mocker runs slowly (``--speedup-ratio 0.1``: about 60 ms a token), so a 300-token request
outlives any graceful timeout here and a 5-token one finishes well within it.

Through a frontend, the handed-over stream is migrated: the client sees one complete stream.
"""

from __future__ import annotations

import asyncio
import signal

import pytest

from dynamo_zmq import errors
from dynamo_zmq.transport import plain_items
from dynamo_zmq.wire import encode_item
from tests.support.churn import (
    frontend,
    openai_client,
    read_stream,
    stream_completion,
    wait_live,
    worker,
)
from tests.support.waiting import until

LONG = 300
MEDIUM = 150
SHORT = 5


def request(max_tokens: int) -> dict:
    return {"token_ids": [1, 2, 3, 4], "stop": {"max_tokens": max_tokens}}


def assert_handed_over(got: list[dict], exc: BaseException | None) -> None:
    """Outputs first, then a retryable EngineShutdown that says it was handed over; no output
    is a terminal (no ``cancelled``, no ``error`` finish)."""
    assert got, "the hand-over came after outputs"
    assert all(o.get("finish_reason") is None for o in got), got[-3:]
    assert isinstance(exc, errors.EngineShutdown) and exc.retryable, repr(exc)
    assert "shutting down" in exc.message and "handed over" in exc.message, exc.message


async def test_sigterm_finishes_what_it_can_and_hands_over_the_rest(
    namespace, spawn, make_runtime, tiny_model
):
    proc = worker(spawn, namespace, tiny_model, "--grace-period", "0.2",
                  "--graceful-timeout", "2")
    client = await make_runtime().endpoint(f"{namespace}.backend.generate").client()
    assert await until(client, lambda: client.instance_ids() == [proc.instance_id], timeout=15)
    short = [await client.generate(request(SHORT)) for _ in range(3)]
    long = [await client.generate(request(LONG)) for _ in range(3)]
    heads = [await s.__anext__() for s in long]  # running in the engine
    readers = [asyncio.create_task(read_stream(s)) for s in (*short, *long)]

    proc.signal(signal.SIGTERM)
    results = await asyncio.wait_for(asyncio.gather(*readers), 30)
    for got, exc in results[:3]:  # finished within the graceful timeout
        assert exc is None and got[-1]["finish_reason"] == "length", (got[-1:], exc)
        assert sum(len(o.get("token_ids", [])) for o in got) == SHORT
    for head, (got, exc) in zip(heads, results[3:], strict=True):
        assert_handed_over([head.data(), *got], exc)
        assert sum(len(o.get("token_ids", [])) for o in [head.data(), *got]) < LONG
    assert await asyncio.to_thread(proc.wait, 30) == 0
    log = proc.logs()
    assert "handed over 3 requests" in log, log


async def test_a_second_signal_hands_over_at_once(namespace, spawn, make_runtime, tiny_model):
    """A second SIGTERM skips the waiting, but in-flight requests are still handed over."""
    proc = worker(spawn, namespace, tiny_model, "--grace-period", "0.2",
                  "--graceful-timeout", "60")
    client = await make_runtime().endpoint(f"{namespace}.backend.generate").client()
    assert await until(client, lambda: client.instance_ids() == [proc.instance_id], timeout=15)
    stream = await client.generate(request(LONG))
    head = await stream.__anext__()
    reading = asyncio.create_task(read_stream(stream))
    proc.signal(signal.SIGTERM)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 15
    while "grace period over" not in proc.logs():
        assert loop.time() < deadline, proc.logs()
        await asyncio.sleep(0.05)
    proc.signal(signal.SIGTERM)
    got, exc = await asyncio.wait_for(reading, 20)  # long before the 60 s graceful timeout
    assert_handed_over([head.data(), *got], exc)
    assert await asyncio.to_thread(proc.wait, 20) == 0


async def test_through_a_frontend_new_requests_go_elsewhere_and_leftovers_are_handed_over(
    namespace, spawn, tiny_model
):
    leaving = worker(spawn, namespace, tiny_model, "--grace-period", "0.3",
                     "--graceful-timeout", "2")
    staying = worker(spawn, namespace, tiny_model)
    url = frontend(spawn, namespace).address
    ids = {f"{leaving.instance_id:x}", f"{staying.instance_id:x}"}
    await wait_live(url, lambda live: live == ids)
    async with openai_client(url) as client:
        # Round-robin over two workers: half of them land on the leaving one.
        started = [asyncio.Event() for _ in range(4)]
        inflight = [asyncio.create_task(stream_completion(client, MEDIUM, ev)) for ev in started]
        await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in started)), 20)

        leaving.signal(signal.SIGTERM)
        after = await asyncio.wait_for(
            asyncio.gather(*(stream_completion(client, SHORT) for _ in range(6))), 30)
        for out in after:  # sent right after SIGTERM: served, by the other worker
            assert out.ok and out.finish == "length", out
            assert out.served_by == f"{staying.instance_id:x}", out
        outcomes = await asyncio.wait_for(asyncio.gather(*inflight), 40)
    assert await asyncio.to_thread(leaving.wait, 30) == 0

    handed = [o for o in outcomes if o.served_by == f"{leaving.instance_id:x}"]
    assert len(handed) == 2, outcomes
    # The leaving worker hands its unfinished streams over and the frontend migrates them: the
    # client sees each as one complete stream, the same text as the streams that were not moved
    # (the mocker's output is a function of the prompt).
    for out in outcomes:
        assert out.ok and out.finish == "length", out
    assert len({o.text for o in outcomes}) == 1, outcomes


async def test_the_engine_aborts_handed_over_requests_before_it_closes(
    namespace, spawn, make_runtime, tiny_model
):
    """The hand-over tells the engine to abort each request (its context is killed), and the
    requests are over before ``engine.cleanup()``; nothing waits for the socket to close."""
    proc = spawn("-m", "dynamo_zmq.worker", "--engine", "tests.support.engines:LifecycleTestEngine",
                 "--model-path", str(tiny_model), "--namespace", namespace, "--host", "127.0.0.1",
                 "--echo-delay", "0.05", "--grace-period", "0.2", "--graceful-timeout", "1")
    client = await make_runtime().endpoint(f"{namespace}.backend.generate").client()
    assert await until(client, lambda: client.instance_ids() == [proc.instance_id], timeout=15)
    streams = [await client.generate(request(LONG)) for _ in range(2)]
    heads = [await s.__anext__() for s in streams]
    readers = [asyncio.create_task(read_stream(s)) for s in streams]
    proc.signal(signal.SIGTERM)
    for head, (got, exc) in zip(heads, await asyncio.wait_for(asyncio.gather(*readers), 20),
                                strict=True):
        assert_handed_over([head.data(), *got], exc)
    assert await asyncio.to_thread(proc.wait, 30) == 0
    events = [line.split("LIFECYCLE ", 1)[1] for line in proc.logs().splitlines()
              if "LIFECYCLE " in line]
    assert events.count("drain inflight=2") == 1, events
    aborts = [i for i, e in enumerate(events) if e.startswith("abort")]
    ends = [i for i, e in enumerate(events) if e.startswith("end")]
    assert len(aborts) == 2 and len(ends) == 2, events
    assert events[-1] == "cleanup inflight=0", events  # after both requests ended


async def test_the_runtime_hands_over_open_streams_and_refuses_new_ones(make_runtime):
    """``DistributedRuntime.hand_over``: each open stream ends with the retryable
    ``EngineShutdown(reason)`` right after the items it sent, its handler sees the kill, and a
    request sent afterwards is refused with ``EngineShutdown`` before any item."""
    server = make_runtime(static=())
    killed: list[bool] = []

    async def count(request, context):
        try:
            for i in range(10_000):
                yield i
                await asyncio.sleep(0.01)
        finally:
            killed.append(context.is_killed())

    await server.endpoint("ns.c.count").start_serving(count)
    client = await make_runtime(static=(server.address,)).endpoint("ns.c.count").client()
    await client.wait_for_instances(timeout=10)
    streams = [await client.generate({}, annotated=False) for _ in range(3)]
    for s in streams:
        assert await s.__anext__() == 0
    assert await server.hand_over("going elsewhere") == 3
    for s in streams:
        with pytest.raises(errors.EngineShutdown, match="going elsewhere"):
            async for _ in s:
                pass
    assert killed == [True, True, True] and server.inflight == 0
    assert client.instance_ids() == []  # draining: callers route elsewhere
    conn = next(iter(client._pool.peers.values()))  # a caller that sends to it anyway
    late = await conn.open_stream("ns.c.count", encode_item({}), decode=plain_items)
    with pytest.raises(errors.EngineShutdown, match="shutting down"):
        async for _ in late:
            pass
