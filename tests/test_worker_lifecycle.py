"""The worker's lifecycle and error taxonomy as the backend-common document specifies them, on
real worker processes: the shutdown order (unregister -> grace period -> ``engine.drain()`` with
requests still in flight -> cleanup), an engine that fails to start (``EngineShutdown``, exit 1,
one line), and an engine that crashes mid-request (``EngineShutdown`` to the caller: retryable,
HTTP 503), for the mocker and for any engine that declares itself dead."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from dynamo_zmq import errors
from tests.support.mocker_fleet import start_frontend
from tests.support.procs import Proc
from tests.support.waiting import until, wait_models

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


def _start_failure(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60)


def test_an_engine_that_fails_to_start_exits_1_with_one_engine_shutdown_line(
    tiny_model, taken_port
):
    res = _start_failure(*worker_args("ns", tiny_model, f"{ENGINES}:FailingStartTestEngine",
                                      "--discovery", "static"))
    assert res.returncode == 1, res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if "ERROR" in ln]
    assert line.endswith(
        "worker failed to start: EngineShutdown: the failing-start engine failed to start: "
        "RuntimeError: no accelerator found (test engine)"
    ), res.stderr
    assert "Traceback" not in res.stderr and "InvalidArgument" not in res.stderr

    # The mocker failing to bind its KV-event socket is the engine failing to start, too.
    res = _start_failure(*worker_args("ns", tiny_model, "mocker", "--discovery", "static",
                                      "--kv-events-port", str(taken_port)))
    assert res.returncode == 1, res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if "ERROR" in ln]
    assert "EngineShutdown: the mocker engine failed to start: cannot bind" in line
    assert f"127.0.0.1:{taken_port}: Address already in use" in line
    assert "Traceback" not in res.stderr


async def _tokens_then_error(stream) -> tuple[int, BaseException | None]:
    tokens = 0
    try:
        async for r in stream:
            tokens += len(r.data().get("token_ids", []))
    except errors.DynamoError as exc:
        return tokens, exc
    return tokens, None


async def test_an_engine_that_declares_itself_dead_fails_requests_with_engine_shutdown(
    namespace, spawn, make_runtime, tiny_model
):
    proc = spawn(*worker_args(namespace, tiny_model, f"{ENGINES}:CrashingTestEngine",
                              "--crash-after", "5", "--bug-token", "666",
                              "--echo-delay", "0.01"))
    client = await make_runtime(static=(proc.address,)).endpoint(
        f"{namespace}.backend.generate").client()
    await client.wait_for_instances(timeout=15)
    # An ordinary bug while the engine is alive stays what it is (not retryable).
    _, exc = await _tokens_then_error(await client.generate(request([666, 1], max_tokens=4)))
    assert isinstance(exc, errors.Unknown) and "a bug in the test engine" in exc.message
    # The engine dies mid-request: the caller gets EngineShutdown, retryable.
    tokens, exc = await _tokens_then_error(await client.generate(request([7] * 3, 50)))
    assert tokens == 5
    assert isinstance(exc, errors.EngineShutdown) and exc.retryable, exc
    assert "the test engine's core process is gone" in exc.message
    # ... and so does every request after it.
    _, exc = await _tokens_then_error(await client.generate(request([8], max_tokens=3)))
    assert isinstance(exc, errors.EngineShutdown), exc


async def test_a_mocker_whose_scheduler_dies_fails_requests_with_engine_shutdown(
    namespace, spawn, make_runtime, tiny_model
):
    proc = spawn(*worker_args(namespace, tiny_model, f"{ENGINES}:CrashingMockerTestEngine",
                              "--crash-at-publish", "4", "--block-size", "4",
                              "--speedup-ratio", "100"))
    client = await make_runtime(static=(proc.address,)).endpoint(
        f"{namespace}.backend.generate").client()
    await client.wait_for_instances(timeout=15)
    tokens, exc = await _tokens_then_error(
        await client.generate(request(list(range(1, 31)), max_tokens=200))
    )
    assert 0 < tokens < 200
    assert isinstance(exc, errors.EngineShutdown) and exc.retryable, exc
    assert re.search(r"mocker rank 0 crashed: OSError\(.simulated failure", exc.message), exc
    tokens, exc = await _tokens_then_error(await client.generate(request([5, 6], 10)))
    assert tokens == 0 and isinstance(exc, errors.EngineShutdown), exc


async def test_a_crashed_engine_is_a_503_through_the_frontend(namespace, spawn, tiny_model):
    spawn(*worker_args(namespace, tiny_model, f"{ENGINES}:CrashingMockerTestEngine",
                       "--crash-at-publish", "3", "--block-size", "4", "--speedup-ratio", "100",
                       "--model-name", "tiny"))
    url = start_frontend(spawn, namespace, mode=None, ready=True).address
    await wait_models(url, {"tiny"})
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Tell me a long story"}],
                max_tokens=200,
            )
        assert caught.value.status_code == 503, caught.value
        assert caught.value.body["code"] == "engine_shutdown", caught.value.body
        with pytest.raises(openai.APIStatusError) as caught:  # and every request after it
            await client.completions.create(model="tiny", prompt="Once upon", max_tokens=5)
        assert caught.value.status_code == 503, caught.value
