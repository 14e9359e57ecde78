"""Per-request cancellation context (Dynamo's ``AsyncEngineContext``, in Python).

A ``Context`` has two one-way levels: *stopped* (finish gracefully: stop generating, end the
stream normally) and *killed* (abandon now; killed implies stopped). Linked children follow
their parent in link order. Passing a context to an outgoing call links the call to it: stopping
the caller's context sends STOP/KILL over the wire, and the server-side context of that request
(same ``id()``) fires.

Thread safety (the document's "Thread Safety"; engines run threads): ``stop_generating``,
``stop``, ``kill`` and ``link_child`` may be called from any thread, and the flags read True at
once in every thread. A context belongs to the event loop it was made in (or, if made outside
one, the first loop that waits on it or adds a listener): its waiters wake and its listeners run
on that loop's thread, in order, once per level, whichever thread stopped it. A context that has
no loop calls its listeners in the thread that stops it.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from asyncio import events
from collections.abc import Callable

__all__ = ["Context"]

Listener = Callable[[bool], None]
"""Called once per level change with ``killed``: False for stop, True for kill."""

_NONE, _STOP, _KILL = 0, 1, 2
"""Levels whose waiters and listeners have run (``Context._fired``)."""

#: Guards contexts that have no loop yet: binding one to a loop, and firing one in the stopping
#: thread (rare: a context made outside an event loop), so listeners never run on two threads.
_unbound = threading.RLock()


class Context:
    """Cancellation state of one request, shared by every hop that serves it."""

    __slots__ = (
        "_children",
        "_fired",
        "_id",
        "_killed",
        "_killed_ev",
        "_listeners",
        "_loop",
        "_stopped",
        "_stopped_ev",
    )

    def __init__(self, id: str | None = None) -> None:
        self._id = id or uuid.uuid4().hex
        self._stopped = False
        self._killed = False
        self._fired = _NONE
        self._children: list[Context] = []
        self._listeners: list[Listener] = []
        self._stopped_ev: asyncio.Event | None = None
        self._killed_ev: asyncio.Event | None = None
        self._loop = events._get_running_loop()

    def __repr__(self) -> str:
        state = "killed" if self._killed else "stopped" if self._stopped else "live"
        return f"Context(id={self._id!r}, {state})"

    def id(self) -> str:
        """The request id this context belongs to (the same on every hop)."""
        return self._id

    def is_stopped(self) -> bool:
        return self._stopped

    def is_killed(self) -> bool:
        return self._killed

    def stop_generating(self) -> None:
        """Ask the producer to finish gracefully (alias of ``stop``, Dynamo's name)."""
        self.stop()

    def stop(self) -> None:
        """Ask the producer to finish gracefully; the stream still ends with its terminal.
        Safe from any thread."""
        if self._stopped:
            return
        self._stopped = True
        for child in list(self._children):
            child.stop()
        self._dispatch()

    def kill(self) -> None:
        """Abandon the request now; implies ``stop``. Safe from any thread."""
        if self._killed:
            return
        self.stop()
        self._killed = True
        for child in list(self._children):
            child.kill()
        self._dispatch()

    async def stopped(self) -> None:
        """Wait until the context is stopped (or killed)."""
        if self._stopped:
            return
        event = self._stopped_ev
        if event is None:
            self._bind()
            event = self._stopped_ev = asyncio.Event()
            if self._stopped:  # stopped by another thread meanwhile
                return
        await event.wait()

    async def killed(self) -> None:
        """Wait until the context is killed."""
        if self._killed:
            return
        event = self._killed_ev
        if event is None:
            self._bind()
            event = self._killed_ev = asyncio.Event()
            if self._killed:
                return
        await event.wait()

    async def async_killed_or_stopped(self) -> bool:
        """Wait until stopped or killed; returns True (Dynamo's signature)."""
        await self.stopped()
        return True

    def link_child(self, child: Context) -> None:
        """Make ``child`` follow this context: stop and kill reach it, in link order. Safe from
        any thread."""
        if child is self:
            raise ValueError("a context cannot be its own child")
        self._children.append(child)
        # Read after the append: a stop in another thread either sees the child or is seen here
        # (both at once is harmless: stop and kill are idempotent).
        if self._killed:
            child.kill()
        elif self._stopped:
            child.stop()

    def add_listener(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(killed)`` on stop and on kill; returns a function that removes it.

        Used by the transport to forward STOP/KILL over the wire. Call it on the context's loop
        (its listeners run there); a listener added to a context that is already stopped/killed
        is called at once.
        """
        self._bind()
        self._listeners.append(listener)
        fired = self._fired
        if fired >= _STOP:
            listener(False)
        if fired >= _KILL:
            listener(True)
        if self._stopped:  # a level another thread reached, whose listeners have not run yet
            self._dispatch()

        def remove() -> None:
            try:
                self._listeners.remove(listener)
            except ValueError:
                pass

        return remove

    # -- delivery --------------------------------------------------------------------------

    def _bind(self) -> None:
        """Make the running loop this context's loop, if it has none (or a closed one)."""
        bound = self._loop
        if bound is None or bound.is_closed():
            loop = events._get_running_loop()
            if loop is not None and loop is not bound:
                with _unbound:
                    if self._loop is bound:
                        self._loop = loop

    def _dispatch(self) -> None:
        """Run ``_fire`` on the context's loop: at once on its thread, else handed over."""
        loop = self._loop
        if loop is None:
            with _unbound:
                if self._loop is None:  # no loop: whoever stops it runs the listeners
                    self._fire()
                    return
                loop = self._loop
        if loop is events._get_running_loop():
            self._fire()
            return
        try:
            loop.call_soon_threadsafe(self._fire)
        except RuntimeError:  # its loop is closed: nothing waits there any more
            self._fire()

    def _fire(self) -> None:
        """Wake the waiters and call the listeners of each level reached, once each (on the
        context's loop)."""
        if self._fired == _NONE and self._stopped:
            self._fired = _STOP
            if self._stopped_ev is not None:
                self._stopped_ev.set()
            for listener in list(self._listeners):
                listener(False)
        if self._fired == _STOP and self._killed:
            self._fired = _KILL
            if self._killed_ev is not None:
                self._killed_ev.set()
            for listener in list(self._listeners):
                listener(True)
