"""vLLM's engine-core processes die with their worker.

With ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` (vLLM's default) vLLM runs its engine core in a child
process (``VLLM::EngineCore``) that does not watch its parent: a worker killed with SIGKILL left
it running, holding its memory (a GPU's, on a GPU) and its KV-event ports. ``install`` makes
vLLM start its engine cores through ``run_engine_core`` here (by fork or spawn alike: the target
is a module-level function), which first starts a thread that waits for the worker to exit
(a pidfd; polling ``getppid`` where there is none) and then ends the engine core: SIGTERM (vLLM
shuts down and stops its own executor processes), SIGKILL if it is still there after
``TERM_GRACE`` seconds.

``PR_SET_PDEATHSIG`` is not used: it fires when the *thread* that forked exits, and vLLM is
started from a thread pool's thread.
"""

from __future__ import annotations

import functools
import os
import select
import signal
import sys
import threading
import time
from typing import Any

__all__ = ["TERM_GRACE", "install", "run_engine_core"]

#: Seconds an orphaned engine core gets to shut down after SIGTERM before SIGKILL.
TERM_GRACE = 5.0
#: Seconds between ``getppid`` checks where pidfds are not available.
POLL = 0.5

#: vLLM's own ``EngineCoreProc.run_engine_core`` (a staticmethod), once ``install`` ran.
_original: Any = None


def install() -> None:
    """Make the engine cores vLLM starts from this process on end when this process does.
    Idempotent."""
    global _original
    from vllm.v1.engine.core import EngineCoreProc

    current = EngineCoreProc.__dict__["run_engine_core"]
    func = getattr(current, "__func__", current)
    if isinstance(func, functools.partial) and func.func is run_engine_core:
        return
    _original = current
    target = functools.partial(run_engine_core, watched_parent=os.getpid())
    EngineCoreProc.run_engine_core = staticmethod(target)


def run_engine_core(*args: Any, watched_parent: int, **kwargs: Any) -> Any:
    """In the engine-core process: watch ``watched_parent``, then run vLLM's engine core."""
    threading.Thread(
        target=_watch, args=(watched_parent,), name="dynamo-parent-watch", daemon=True
    ).start()
    original = _original
    if original is None:  # a spawned child: vLLM's class is its own, unpatched
        from vllm.v1.engine.core import EngineCoreProc

        original = EngineCoreProc.__dict__["run_engine_core"]
    return getattr(original, "__func__", original)(*args, **kwargs)


def _watch(parent: int) -> None:
    _wait_for_exit(parent)
    me = os.getpid()
    print(f"dynamo-zmq: worker process {parent} is gone: ending its vLLM engine core {me}",
          file=sys.stderr, flush=True)
    os.kill(me, signal.SIGTERM)
    time.sleep(TERM_GRACE)
    os.kill(me, signal.SIGKILL)


def _wait_for_exit(parent: int) -> None:
    """Return once process ``parent`` has exited (at once if it already has)."""
    try:
        fd = os.pidfd_open(parent)
    except (AttributeError, OSError):
        fd = -1
    try:
        if os.getppid() != parent:  # gone before the watch began (we were reparented)
            return
        if fd >= 0:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            while not poller.poll():
                pass
            return
        while os.getppid() == parent:
            time.sleep(POLL)
    finally:
        if fd >= 0:
            os.close(fd)
