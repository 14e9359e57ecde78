"""Several discovery backends as one (``--discovery mdns,dir``): mDNS for the hosts of this
subnet, the shared directory for the rest.

Every advert goes to every backend. A watch merges the backends' events: a peer is added when
the first backend reports it (an instance is keyed by namespace and instance id, so the same
instance seen by two backends is one peer, at the address the first gave) and removed only
when every backend that reported it has removed it (stale only if every removal was).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from ..resources import cancel_and_wait
from ._base import Advert, Discovery, DiscoveryEvent, PeerAdded, PeerRemoved

__all__ = ["CombinedDiscovery"]

_Key = tuple[str | None, int | str]


class _Peer:
    __slots__ = ("by", "event", "stale")

    def __init__(self, event: PeerAdded) -> None:
        self.event = event  # what was passed on (the first backend's address)
        self.by: dict[int, str] = {}  # backend -> the address it reported
        self.stale = True  # every removal since it was added was a stale one


class _Merger:
    """The merged view of one watch (see the module)."""

    def __init__(self) -> None:
        self.peers: dict[_Key, _Peer] = {}
        self.where: dict[tuple[int, str], _Key] = {}  # (backend, address) -> peer

    def apply(self, source: int, event: DiscoveryEvent) -> DiscoveryEvent | None:
        """Apply one backend's event; the merged event to pass on, if any."""
        if isinstance(event, PeerAdded):
            return self._added(source, event)
        key = self.where.pop((source, event.address), None)
        if key is None:
            return None
        peer = self.peers[key]
        if peer.by.pop(source, None) is None:
            return None
        peer.stale = peer.stale and event.stale
        if peer.by:
            return None  # another backend still reports it
        del self.peers[key]
        return PeerRemoved(peer.event.address, peer.event.instance_id, stale=peer.stale)

    def _added(self, source: int, event: PeerAdded) -> PeerAdded | None:
        key: _Key = (event.namespace, event.instance_id or event.address)
        peer = self.peers.get(key)
        if peer is None:
            peer = self.peers[key] = _Peer(event)
            passed: PeerAdded | None = event
        elif event.address == peer.event.address and event != peer.event:
            peer.event = passed = event  # the same address with new hints
        else:
            passed = None
        old = peer.by.get(source)
        if old is not None and old != event.address:
            self.where.pop((source, old), None)
        peer.by[source] = event.address
        self.where[(source, event.address)] = key
        return passed


class CombinedDiscovery(Discovery):
    """``backends`` behind one ``Discovery`` (see the module)."""

    def __init__(self, backends: Sequence[Discovery]) -> None:
        self.backends = list(backends)

    async def start(self) -> None:
        for backend in self.backends:
            await backend.start()

    async def advertise(self, advert: Advert) -> None:
        for backend in self.backends:
            await backend.advertise(advert)

    async def renew(self, advert: Advert) -> str | None:
        """Renew with each backend; the first reason one cannot keep the advert is the
        lease's."""
        for backend in self.backends:
            if (reason := await backend.renew(advert)) is not None:
                return reason
        return None

    async def withdraw(self, advert: Advert) -> None:
        for backend in self.backends:
            await backend.withdraw(advert)

    def refresh(self) -> None:
        for backend in self.backends:
            backend.refresh()

    async def watch(self, namespace: str | None = None) -> AsyncIterator[DiscoveryEvent]:
        """The backends' events for ``namespace``, merged (see the module)."""
        queue: asyncio.Queue[tuple[int, DiscoveryEvent | None]] = asyncio.Queue()

        async def pump(i: int, backend: Discovery) -> None:
            events = backend.watch(namespace)
            try:
                async for event in events:
                    queue.put_nowait((i, event))
            finally:
                queue.put_nowait((i, None))
                aclose = getattr(events, "aclose", None)
                if aclose is not None:
                    await aclose()

        tasks = [asyncio.get_running_loop().create_task(pump(i, b), name=f"discovery-{i}")
                 for i, b in enumerate(self.backends)]
        merged = _Merger()
        running = len(tasks)
        try:
            while running:
                i, event = await queue.get()
                if event is None:
                    running -= 1
                    continue
                out = merged.apply(i, event)
                if out is not None:
                    yield out
        finally:
            await cancel_and_wait(tasks)

    async def close(self) -> None:
        for backend in self.backends:
            await backend.close()
