"""The runtime's primary lease: Dynamo's etcd lease, without etcd.

In Dynamo every registration of a ``DistributedRuntime`` hangs off one etcd lease; the lease id
names the instance (``{endpoint}-{lease_id}``), and the runtime's cancellation token is tied to
the lease: when the lease is revoked or cannot be kept alive, the registrations vanish and the
runtime shuts down. Here the lease id is the instance id every advert carries; discovery keeps
the registrations (mDNS re-announces; a static list has nothing to lose), and the lease is lost
when it is revoked or when discovery cannot keep a registration. A lost lease stays lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

__all__ = ["Lease"]

log = logging.getLogger(__name__)


class Lease:
    """One runtime's primary lease (``DistributedRuntime.primary_lease()``).

    Args:
        lease_id: the id, equal to the runtime's instance id.
    """

    __slots__ = ("_event", "_id", "_listeners", "_reason")

    def __init__(self, lease_id: int) -> None:
        self._id = lease_id
        self._reason: str | None = None
        self._listeners: list[Callable[[str], None]] = []
        self._event: asyncio.Event | None = None

    def __repr__(self) -> str:
        state = "valid" if self._reason is None else f"lost: {self._reason}"
        return f"Lease({self._id:x}, {state})"

    def id(self) -> int:
        """The lease id: the instance id in every registration of the runtime."""
        return self._id

    def is_valid(self) -> bool:
        """False once the lease was revoked or lost."""
        return self._reason is None

    @property
    def reason(self) -> str | None:
        """Why the lease was lost (``None`` while it is valid)."""
        return self._reason

    def revoke(self, reason: str = "revoked") -> None:
        """End the lease: the runtime withdraws its registrations and shuts down. Idempotent."""
        if self._reason is not None:
            return
        self._reason = reason
        log.warning("lease %x lost (%s): the runtime stops serving", self._id, reason)
        if self._event is not None:
            self._event.set()
        for listener in list(self._listeners):
            try:
                listener(reason)
            except Exception:
                log.exception("a lease listener failed")

    async def lost(self) -> str:
        """Wait until the lease is revoked or lost; returns why."""
        if self._reason is None:
            if self._event is None:
                self._event = asyncio.Event()
            await self._event.wait()
        assert self._reason is not None
        return self._reason

    def add_listener(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(reason)`` when the lease ends (at once if it already has)."""
        self._listeners.append(listener)
        if self._reason is not None:
            listener(self._reason)
