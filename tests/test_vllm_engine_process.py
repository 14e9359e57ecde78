"""vLLM's engine-core process dies with its worker, and a worker restarted on the same ports is
not blocked by what its predecessor left (issue 20 item 6; and the CI flake of a KV-event port
taken between picking it and vLLM binding it).

vLLM's ``AsyncLLM`` always runs its engine core in a child process (``VLLM::EngineCore``); with
``VLLM_ENABLE_V1_MULTIPROCESSING=1`` that process has an executor process of its own. A worker
killed with SIGKILL left them running. Here: a worker in multiprocessing mode is SIGKILLed and
its engine-core process tree must be gone within a bounded wait; then a port the next worker
needs is held (as a leftover would hold it), the next worker on the same ports waits, tries
vLLM, sees the port in use and starts vLLM again once it is free, and serves.

Runs only where vLLM is installed (skipped otherwise, failed in CI: see tests/test_vllm.py).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import pytest

import tests.support.needs_vllm  # noqa: F401  (skips this module without vLLM; fails it in CI)

# isort: split

from engines.vllm._endpoints import free_port
from tests.support.churn import read_stream
from tests.support.procs import Proc, children
from tests.support.vllm_stack import VLLM_ENV, WORKER_FLAGS, WORKER_START
from tests.support.waiting import until

pytestmark = [pytest.mark.timeout(900)]

#: Seconds the engine-core processes of a killed worker may take to end (SIGTERM, then SIGKILL
#: 5 s later where vLLM's own shutdown does not finish).
ORPHAN_DEADLINE = 30



def descendants(pid: int) -> list[int]:
    out: list[int] = []
    for child in children(pid):
        out += [child, *descendants(child)]
    return out


def comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def vllm_worker(model: object, namespace: str, port: int, events: int, replay: int,
                multiprocessing: bool) -> Proc:
    env = {**VLLM_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocessing else "0"}
    return Proc(["-m", "dynamo_zmq.worker", "--engine", "vllm", "--model-path", str(model),
                 "--model-name", "tiny", "--namespace", namespace, "--host", "127.0.0.1",
                 "--port", str(port), "--kv-events-port", str(events),
                 "--kv-replay-port", str(replay), *WORKER_FLAGS], env=env)


async def test_engine_processes_die_with_a_killed_worker_and_a_restart_serves(
    tiny_model, namespace, make_runtime
):
    port = free_port()
    events = free_port(exclude=port)
    replay = next(p for p in iter(free_port, 0) if p not in (port, events))
    procs: list[Proc] = []
    leftovers: list[int] = []
    try:
        first = vllm_worker(tiny_model, namespace, port, events, replay, multiprocessing=True)
        procs.append(first)
        first.wait_ready(WORKER_START)
        engine = [c for c in children(first.pid) if comm(c).startswith("VLLM::EngineCor")]
        assert len(engine) == 1, [(c, comm(c)) for c in children(first.pid)]
        leftovers = [engine[0], *descendants(engine[0])]
        assert len(leftovers) >= 2, "multiprocessing mode: the engine core has an executor"

        first.signal(signal.SIGKILL)
        deadline = time.monotonic() + ORPHAN_DEADLINE
        while any(alive(p) for p in leftovers):
            assert time.monotonic() < deadline, [(p, comm(p)) for p in leftovers if alive(p)]
            await asyncio.sleep(0.2)

        # A leftover still holding a KV-event port the next worker binds (as a dead
        # predecessor's engine core did): the next worker waits, fails to bind it, starts vLLM
        # again once it is free.
        holder = socket.socket()
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("", events))
        holder.listen()
        try:
            second = vllm_worker(tiny_model, namespace, port, events, replay,
                                 multiprocessing=False)
            procs.append(second)
            deadline = time.monotonic() + WORKER_START
            while "starting it again" not in second.logs():
                assert second.popen.poll() is None, second.logs()[-3000:]
                assert time.monotonic() < deadline, second.logs()[-3000:]
                await asyncio.sleep(0.5)
        finally:
            holder.close()
        await asyncio.to_thread(second.wait_ready, WORKER_START)
        assert second.address.endswith(f":{port}"), second.address

        client = await make_runtime().endpoint(f"{namespace}.backend.generate").client()
        assert await until(client, lambda: client.instance_ids() == [second.instance_id],
                           timeout=30)
        stream = await client.generate({"token_ids": [1, 2, 3, 4],
                                        "stop": {"max_tokens": 4, "ignore_eos": True}})
        got, exc = await asyncio.wait_for(read_stream(stream), 60)
        assert exc is None, repr(exc)
        assert got[-1]["finish_reason"] == "length", got[-1]
        assert sum(len(o.get("token_ids", [])) for o in got) == 4
    finally:
        for proc in procs:
            proc.stop()
        for pid in leftovers:  # only if the test failed: never leave them running
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
