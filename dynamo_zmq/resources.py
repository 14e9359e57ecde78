"""One owner for what a process runs in the background: its ZMQ context, tasks and closers.

Every component that spawns a task or opens a socket takes a ``Resources`` from its owner (the
runtime's, or a ``child()`` of it) instead of calling ``asyncio.create_task`` or making a
``zmq.Context`` itself. Closing a ``Resources`` cancels its tasks and awaits them, runs its
closers (last registered first) and closes its children (last created first), once: a second
``close()`` returns at once. Tasks are awaited with ``asyncio.wait``, which never raises the
awaited task's exception or cancellation, so the closer's own cancellation always propagates
(``contextlib.suppress(BaseException): await task`` would swallow it).

The process has one ZMQ context, ``zmq.Context.instance()``: every ``Resources`` hands it out,
and none destroys it (sockets are closed by their owners; the context lives as long as the
process, so one runtime closing cannot break another's sockets in the same process).

``die_with_parent_hook`` has the kernel SIGTERM a child process when this one dies (Linux,
``PR_SET_PDEATHSIG``): the children a process starts end with it.
"""

from __future__ import annotations

import asyncio
import ctypes
import inspect
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

import zmq

__all__ = [
    "Resources", "cancel_and_wait", "die_with_parent_hook", "process_zmq_context", "wait_event",
]

log = logging.getLogger(__name__)

#: Sockets the process's ZMQ context allows (libzmq's default, 1023, is two per peer for about
#: 500 peers: a frontend in front of a large cluster needs more).
MAX_SOCKETS = 32768

T = TypeVar("T")

Closer = Callable[[], "Awaitable[None] | None"]


class Resources:
    """Tasks, closers and child owners of one component (or of the whole process).

    Args:
        name: what owns them (used in task names and logs).
        parent: the owner this one belongs to; closing the parent closes this one too.
    """

    def __init__(self, name: str = "process", parent: Resources | None = None) -> None:
        self.name = name
        self._parent = parent
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closers: list[Closer] = []
        self._children: list[Resources] = []
        self._closed = False
        self._closing: asyncio.Future[None] | None = None

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._tasks)} tasks"
        return f"Resources({self.name!r}, {state})"

    @property
    def zctx(self) -> zmq.Context[zmq.Socket[bytes]]:
        """The process's ZMQ context (``process_zmq_context()``)."""
        return process_zmq_context()

    @property
    def closed(self) -> bool:
        return self._closed

    def spawn(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        """Run ``coro`` as a named task this owner cancels and awaits on ``close``.

        A task that fails (not cancelled) has its exception logged when it ends.

        Raises:
            RuntimeError: the owner is closed (the coroutine is closed, not run).
        """
        if self._closed:
            coro.close()
            raise RuntimeError(f"{self.name} is closed: cannot spawn {name}")
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def on_close(self, closer: Closer) -> None:
        """Call ``closer()`` (sync or async) on ``close``, after the tasks are cancelled; closers
        run last registered first, so a socket registered after its context closes before it."""
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")
        self._closers.append(closer)

    def child(self, name: str) -> Resources:
        """A ``Resources`` closed with this one (before this one's own tasks and closers), or
        earlier on its own."""
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")
        child = Resources(f"{self.name}/{name}", parent=self)
        self._children.append(child)
        return child

    async def close(self) -> None:
        """Close children (newest first), cancel and await tasks, run closers (newest first).

        Idempotent; a concurrent call waits for the first to finish. A closer that raises is
        logged and the others still run.
        """
        if self._closing is not None:
            await asyncio.shield(self._closing)
            return
        self._closing = asyncio.get_running_loop().create_future()
        self._closed = True
        try:
            for child in reversed(self._children):
                await child.close()
            await cancel_and_wait(self._tasks)
            for closer in reversed(self._closers):
                try:
                    result = closer()
                    if inspect.isawaitable(result):
                        await result
                except Exception:
                    log.exception("%s: a closer failed", self.name)
        finally:
            self._children.clear()
            self._closers.clear()
            if self._parent is not None:
                self._parent._forget(self)
            self._closing.set_result(None)

    def _forget(self, child: Resources) -> None:
        if child in self._children:
            self._children.remove(child)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("%s: task %s failed", self.name, task.get_name(), exc_info=exc)


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait until they have ended.

    Their exceptions and cancellations are not raised here; if the caller itself is cancelled
    while waiting, that cancellation propagates (the tasks still end on their own). The calling
    task itself is never cancelled (a component closing from one of its own tasks).
    """
    current = asyncio.current_task()
    pending = [task for task in tasks if not task.done() and task is not current]
    loop = asyncio.get_running_loop()
    foreign = [task for task in pending if task.get_loop() is not loop]
    if foreign:
        # Waiting would hang for ever: their loop is not the one running.
        raise RuntimeError(
            f"cannot close tasks of another event loop ({foreign[0].get_name()}, ...): close "
            "them from the loop that started them"
        )
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending)


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait until ``event`` is set or ``timeout`` seconds pass; True if it is set.

    Unlike ``asyncio.wait_for(event.wait(), timeout)`` on Python 3.10/3.11, a cancellation
    that arrives just as the event is set is never lost (``wait_for`` then returns instead of
    raising, and a loop around it runs on: a task its owner can no longer close).
    """
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait((waiter,), timeout=timeout)
    finally:
        waiter.cancel()
    return event.is_set()


def process_zmq_context() -> zmq.Context[zmq.Socket[bytes]]:
    """The process's one ZMQ context (``zmq.Context.instance()``, allowing ``MAX_SOCKETS``).

    Engines and other code that open ZMQ sockets outside a ``Resources`` use this too, so a
    process has a single context and a single ZMQ I/O thread.
    """
    global _configured
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    if not _configured:
        _configured = True
        ctx.set(zmq.MAX_SOCKETS, MAX_SOCKETS)
    return ctx


_configured = False


_PR_SET_PDEATHSIG = 1
# Loaded here, in the parent: after fork only the prctl call itself runs (no dlopen).
_libc: Any = None
if sys.platform == "linux":
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        _libc = None


def _die_with_parent() -> None:
    """In the child, before exec: ask the kernel for SIGTERM when the parent dies."""
    _libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def die_with_parent_hook() -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` that has the kernel SIGTERM the child when this
    process dies (None where that is not available: not Linux). Start such children from the
    main thread: the kernel signals them when the thread that started them ends."""
    return _die_with_parent if _libc is not None else None
