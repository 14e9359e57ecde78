"""The frontend always finishes shutting down (a CI flake of issue 20): a frontend that could not
bind its HTTP port hung for ever in its lifespan shutdown when a worker was discovered at that
moment. Its model manager's follow loop waited for peer changes with ``asyncio.wait_for``, which
on Python 3.10/3.11 loses a cancellation that arrives as the awaited event is set: the loop ran
on and ``close()`` waited for it for ever. Here the same race, made deterministic on a real
runtime; a shutdown that still does not finish (a router plugin's close that never returns) ends
at the frontend's deadline; and the quickstart's worker and frontend die with it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

from dynamo_zmq.frontend.models import ModelManager
from tests.support.churn import wait_live, worker
from tests.support.procs import ROOT, children, pythonpath
from tests.support.stuck_router import install_stuck_router


async def test_the_model_manager_closes_while_a_peer_appears(make_runtime, namespace):
    runtime = make_runtime(static=())
    manager = ModelManager(runtime, namespace)
    await manager.start()
    pool = await runtime.peer_pool(namespace)
    await asyncio.sleep(0.3)  # the manager's loop now waits for the next peer change (1 s)
    # A peer appears (its wait wakes) and the manager closes in the same turn of the loop.
    pool.add("tcp://127.0.0.1:9")
    closing = asyncio.ensure_future(manager.close())
    done, _ = await asyncio.wait({closing}, timeout=10)
    assert closing in done, "ModelManager.close() never returned"


async def test_a_shutdown_that_does_not_finish_ends_at_its_deadline(
    namespace, spawn, tiny_model, tmp_path
):
    """A router whose close never returns (a plugin's): the frontend still exits, at its
    shutdown deadline, saying so."""
    proc = worker(spawn, namespace, tiny_model)
    plugins = install_stuck_router(tmp_path / "plugins")
    front = spawn("-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace", namespace,
                  "--router-mode", "stuck-close", env={"PYTHONPATH": str(plugins)})
    await wait_live(front.address, lambda live: live == {f"{proc.instance_id:x}"})
    front.signal(signal.SIGTERM)
    assert await asyncio.to_thread(front.wait, 40) == 1
    assert "shutdown did not finish within 10s: exiting anyway" in front.logs(), front.logs()



def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_quickstarts_children_die_with_it(tmp_path):
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dynamo_zmq", "quickstart", "--http-port", "0",
         "--model-dir", str(tmp_path / "model")],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT, env=env, text=True,
    )
    kids: list[int] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        for line in proc.stdout:  # serving once it prints how to try it
            if "Ctrl-C stops" in line:
                break
            assert time.monotonic() < deadline
        kids = children(proc.pid)
        assert len(kids) == 2, kids  # the worker and the frontend
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 30
        while any(_alive(c) for c in kids):
            assert time.monotonic() < deadline, [c for c in kids if _alive(c)]
            time.sleep(0.1)
    finally:
        for pid in [proc.pid, *kids]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait(10)
