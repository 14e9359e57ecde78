"""The worker's lifecycle as the backend-common document specifies it, on real worker processes:
the shutdown order (unregister -> grace period -> ``engine.drain()`` with requests still in
flight -> cleanup), and a second signal that stops waiting."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from dynamo_zmq import errors
from tests.support.procs import Proc
from tests.support.waiting import until

ENGINES = "tests.support.engines"


def worker_args(namespace: str, model: Path, engine: str, *extra: str) -> list[str]:
    return ["-m", "dynamo_zmq.worker", "--engine", engine, "--model-path", str(model),
            "--namespace", namespace, "--host", "127.0.0.1", *extra]


def request(tokens: list[int], max_tokens: int) -> dict:
    return {"token_ids": tokens, "stop": {"max_tokens": max_tokens}}


def full_log(proc: Proc) -> str:
    return Path(proc.log.name).read_text(errors="replace")


def lifecycle(log: str) -> list[str]:
    """The worker's shutdown lines and the test engine's LIFECYCLE lines, in order."""
    keep = ("LIFECYCLE ", "shutting down:", "grace period over", "worker stopped")
    return [line.split(": ", 1)[1] for line in log.splitlines()
            if ": " in line and any(k in line for k in keep)]


async def test_shutdown_order_drains_the_engine_while_requests_run(
    namespace, spawn, make_runtime, tiny_model
):
    proc = spawn(*worker_args(namespace, tiny_model, f"{ENGINES}:LifecycleTestEngine",
                              "--echo-delay", "0.05", "--grace-period", "0.5"))
    client = await make_runtime().endpoint(f"{namespace}.backend.generate").client()
    assert await until(client, lambda: client.instance_ids() == [proc.instance_id], timeout=15)
    streams = [await client.generate(request([1, 2, 3], max_tokens=100)) for _ in range(3)]
    heads = [await s.__anext__() for s in streams]  # all three are running in the engine

    proc.signal(signal.SIGTERM)
    assert await until(client, lambda: client.instance_ids() == [], timeout=5)  # unregistered
    for head, stream in zip(heads, streams, strict=True):
        chunks = [head.data(), *[r.data() async for r in stream]]
        assert sum(len(c.get("token_ids", [])) for c in chunks) == 100
        assert chunks[-1]["finish_reason"] == "length"
    assert await asyncio.to_thread(proc.wait, 30) == 0

    events = lifecycle(full_log(proc))
    order = [e for e in events if not e.startswith("LIFECYCLE end")]
    expected = ["LIFECYCLE start", "shutting down: unregistering",
                "grace period over: refusing new requests", "LIFECYCLE drain",
                "LIFECYCLE cleanup", "worker stopped"]
    assert len(order) == len(expected), events
    assert all(e.startswith(x) for e, x in zip(order, expected, strict=True)), events
    # drain() came while the three requests were still running, and they ended after it,
    # before cleanup.
    drain, cleanup = order[3], order[4]
    assert drain == "LIFECYCLE drain inflight=3", events
    assert cleanup == "LIFECYCLE cleanup inflight=0", events
    ends = [i for i, e in enumerate(events) if e.startswith("LIFECYCLE end")]
    assert len(ends) == 3, events
    assert events.index(drain) < min(ends) and max(ends) < events.index(cleanup), events


async def test_a_second_signal_stops_waiting_for_in_flight_requests(
    namespace, spawn, make_runtime, tiny_model
):
    proc = spawn(*worker_args(namespace, tiny_model, f"{ENGINES}:LifecycleTestEngine",
                              "--echo-delay", "0.05", "--grace-period", "0.2"))
    client = await make_runtime(static=(proc.address,)).endpoint(
        f"{namespace}.backend.generate").client()
    await client.wait_for_instances(timeout=15)
    stream = await client.generate(request([1, 2, 3], max_tokens=100_000))
    await stream.__anext__()
    reading = asyncio.create_task(_tokens_then_error(stream))
    proc.signal(signal.SIGTERM)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 15
    while "LIFECYCLE drain inflight=1" not in full_log(proc):
        assert loop.time() < deadline, full_log(proc)
        await asyncio.sleep(0.05)
    proc.signal(signal.SIGTERM)
    assert await asyncio.to_thread(proc.wait, 20) == 0
    _, exc = await asyncio.wait_for(reading, 20)
    assert isinstance(exc, errors.EngineShutdown), exc  # cut off, retryable elsewhere
    events = lifecycle(full_log(proc))
    assert any(e.startswith("LIFECYCLE cleanup") for e in events), events
    assert events[-1] == "worker stopped", events


async def _tokens_then_error(stream) -> tuple[int, BaseException | None]:
    tokens = 0
    try:
        async for r in stream:
            tokens += len(r.data().get("token_ids", []))
    except errors.DynamoError as exc:
        return tokens, exc
    return tokens, None
