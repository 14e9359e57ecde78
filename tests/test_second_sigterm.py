"""A second SIGTERM (operator impatience) under load, on real mocker workers (issue 20 item 7):
the streams still running end with a retryable ``EngineShutdown`` (503 semantics) after their
outputs, never ``internal_error`` from the engine's shutdown; through a frontend without
migration the client gets a 503-type error, with migration and a second worker each stream
completes. The second signal comes at several points of the shutdown (during the grace period,
during the drain)."""

from __future__ import annotations

import asyncio
import signal

import pytest

from dynamo_zmq import errors
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
#: Streams in flight when the signals come (half running in the mocker, half queued).
LOAD = 40


def request(max_tokens: int) -> dict:
    return {"token_ids": [1, 2, 3, 4], "stop": {"max_tokens": max_tokens}}


@pytest.mark.parametrize("gap", [0.1, 0.8])  # grace period 0.5 s: inside it, then the drain
async def test_a_second_sigterm_under_load_hands_every_stream_over(
    namespace, spawn, make_runtime, tiny_model, gap
):
    # Room for half the streams: the others wait in the engine's queue.
    proc = worker(spawn, namespace, tiny_model, "--grace-period", "0.5",
                  "--graceful-timeout", "60", "--max-num-seqs", str(LOAD // 2))
    client = await make_runtime().endpoint(f"{namespace}.backend.generate").client()
    assert await until(client, lambda: client.instance_ids() == [proc.instance_id], timeout=15)
    streams = [await client.generate(request(LONG)) for _ in range(LOAD)]
    heads = [await s.__anext__() for s in streams[: LOAD // 2]]  # these are running
    readers = [asyncio.create_task(read_stream(s)) for s in streams]
    proc.signal(signal.SIGTERM)
    await asyncio.sleep(gap)
    proc.signal(signal.SIGTERM)
    results = await asyncio.wait_for(asyncio.gather(*readers), 30)
    for i, (got, exc) in enumerate(results):
        outputs = [heads[i].data(), *got] if i < len(heads) else got
        assert all(o.get("finish_reason") is None for o in outputs), outputs[-2:]
        assert isinstance(exc, errors.EngineShutdown) and exc.retryable, repr(exc)
        assert "handed over" in exc.message, exc.message
    assert await asyncio.to_thread(proc.wait, 20) == 0
    assert "second signal" in proc.logs(), proc.logs()


async def test_through_a_frontend_without_migration_the_client_gets_a_503_type_error(
    namespace, spawn, tiny_model
):
    proc = worker(spawn, namespace, tiny_model, "--grace-period", "0.5",
                  "--graceful-timeout", "60")
    url = frontend(spawn, namespace, "--migration-limit", "0").address
    await wait_live(url, lambda live: live == {f"{proc.instance_id:x}"})
    async with openai_client(url) as client:
        started = [asyncio.Event() for _ in range(4)]
        inflight = [asyncio.create_task(stream_completion(client, LONG, ev)) for ev in started]
        await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in started)), 20)
        proc.signal(signal.SIGTERM)
        await asyncio.sleep(0.8)
        proc.signal(signal.SIGTERM)
        outcomes = await asyncio.wait_for(asyncio.gather(*inflight), 30)
    for out in outcomes:
        assert out.chunks > 0 and out.finish is None and out.error is not None, out
        # EngineShutdown, as the 503 status a refused request gets: service unavailable
        assert out.error.get("type") == "service_unavailable_error", out
        assert out.error.get("code") == "engine_shutdown", out
    assert await asyncio.to_thread(proc.wait, 20) == 0


async def test_through_a_frontend_with_migration_the_streams_complete_elsewhere(
    namespace, spawn, tiny_model
):
    leaving = worker(spawn, namespace, tiny_model, "--grace-period", "0.5",
                     "--graceful-timeout", "60")
    staying = worker(spawn, namespace, tiny_model)
    url = frontend(spawn, namespace).address
    await wait_live(url, lambda live: live == {f"{leaving.instance_id:x}",
                                               f"{staying.instance_id:x}"})
    async with openai_client(url) as client:
        started = [asyncio.Event() for _ in range(6)]
        inflight = [asyncio.create_task(stream_completion(client, LONG // 2, ev))
                    for ev in started]
        await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in started)), 20)
        leaving.signal(signal.SIGTERM)
        await asyncio.sleep(0.8)
        leaving.signal(signal.SIGTERM)
        outcomes = await asyncio.wait_for(asyncio.gather(*inflight), 60)
    assert await asyncio.to_thread(leaving.wait, 20) == 0
    assert any(o.served_by == f"{leaving.instance_id:x}" for o in outcomes), outcomes
    for out in outcomes:
        assert out.ok and out.finish == "length", out
    assert len({o.text for o in outcomes}) == 1, outcomes
