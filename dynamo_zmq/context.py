"""Per-request cancellation context (Dynamo's ``AsyncEngineContext``, in Python).

A ``Context`` has two one-way levels: *stopped* (finish gracefully: stop generating, end the
stream normally) and *killed* (abandon now; killed implies stopped). Linked children follow
their parent in link order. Passing a context to an outgoing call links the call to it: stopping
the caller's context sends STOP/KILL over the wire, and the server-side context of that request
(same ``id()``) fires.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

__all__ = ["Context"]

Listener = Callable[[bool], None]
"""Called once per level change with ``killed``: False for stop, True for kill."""


class Context:
    """Cancellation state of one request, shared by every hop that serves it."""

    __slots__ = (
        "_children", "_id", "_killed", "_killed_ev", "_listeners", "_stopped", "_stopped_ev"
    )

    def __init__(self, id: str | None = None) -> None:
        self._id = id or uuid.uuid4().hex
        self._stopped = False
        self._killed = False
        self._children: list[Context] = []
        self._listeners: list[Listener] = []
        self._stopped_ev: asyncio.Event | None = None
        self._killed_ev: asyncio.Event | None = None

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
        """Ask the producer to finish gracefully; the stream still ends with its terminal."""
        if self._stopped:
            return
        self._stopped = True
        if self._stopped_ev is not None:
            self._stopped_ev.set()
        self._notify(killed=False)

    def kill(self) -> None:
        """Abandon the request now; implies ``stop``."""
        if self._killed:
            return
        self.stop()
        self._killed = True
        if self._killed_ev is not None:
            self._killed_ev.set()
        self._notify(killed=True)

    async def stopped(self) -> None:
        """Wait until the context is stopped (or killed)."""
        if self._stopped:
            return
        if self._stopped_ev is None:
            self._stopped_ev = asyncio.Event()
        await self._stopped_ev.wait()

    async def killed(self) -> None:
        """Wait until the context is killed."""
        if self._killed:
            return
        if self._killed_ev is None:
            self._killed_ev = asyncio.Event()
        await self._killed_ev.wait()

    async def async_killed_or_stopped(self) -> bool:
        """Wait until stopped or killed; returns True (Dynamo's signature)."""
        await self.stopped()
        return True

    def link_child(self, child: Context) -> None:
        """Make ``child`` follow this context: stop and kill reach it, in link order."""
        if child is self:
            raise ValueError("a context cannot be its own child")
        self._children.append(child)
        if self._killed:
            child.kill()
        elif self._stopped:
            child.stop()

    def add_listener(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(killed)`` on stop and on kill; returns a function that removes it.

        Used by the transport to forward STOP/KILL over the wire. A listener added to a context
        that is already stopped/killed is called at once.
        """
        self._listeners.append(listener)
        if self._stopped:
            listener(False)
        if self._killed:
            listener(True)

        def remove() -> None:
            try:
                self._listeners.remove(listener)
            except ValueError:
                pass

        return remove

    def _notify(self, killed: bool) -> None:
        for child in list(self._children):
            if killed:
                child.kill()
            else:
                child.stop()
        for listener in list(self._listeners):
            listener(killed)
