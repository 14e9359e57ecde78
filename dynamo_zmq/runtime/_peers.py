"""The set of remote instances this process knows, fed by discovery, kept honest by liveness.

Discovery says where peers might be; a ``PeerConnection`` to each address finds out who is
there and whether it is alive. ``PeerPool`` answers "which live instances serve endpoint E" and
lets callers wait for that answer to change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import zmq

from ..discovery import Discovery, PeerAdded, PeerRemoved
from ..transport import PeerConnection, PeerState

__all__ = ["PeerPool"]

log = logging.getLogger(__name__)

#: A withdrawn (cleanly unregistered) peer with no open streams is closed after this long.
WITHDRAWN_LINGER = 2.0


class PeerPool:
    """Connections to every discovered peer, keyed by address."""

    def __init__(self, zctx: zmq.Context, discovery: Discovery) -> None:
        self._zctx = zctx
        self._discovery = discovery
        self.peers: dict[str, PeerConnection] = {}
        self._withdrawn: dict[str, float] = {}
        self._watchers: dict[str | None, asyncio.Task[None]] = {}
        self._changed = asyncio.Event()
        self._janitor: asyncio.Task[None] | None = None
        self._closed = False

    def watch(self, namespace: str | None) -> None:
        """Follow discovery for ``namespace`` (idempotent)."""
        if self._closed or namespace in self._watchers or None in self._watchers:
            return
        self._watchers[namespace] = asyncio.create_task(
            self._watch(namespace), name=f"discovery-watch-{namespace}"
        )
        if self._janitor is None:
            self._janitor = asyncio.create_task(self._janitor_loop(), name="peer-janitor")

    def instances(self, path: str) -> list[PeerConnection]:
        """Routable connections serving endpoint ``path``, one per instance id, by instance id."""
        by_id: dict[int, PeerConnection] = {}
        for conn in self.peers.values():
            desc = conn.description
            if not conn.routable or desc is None or conn.address in self._withdrawn:
                continue
            if any(ep.path == path for ep in desc.endpoints):
                by_id.setdefault(desc.instance_id, conn)
        return [by_id[i] for i in sorted(by_id)]

    async def wait_changed(self, timeout: float | None = None) -> None:
        """Wait for the next change of any peer (or the timeout)."""
        self._changed.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    def add(self, address: str) -> PeerConnection:
        """Connect to ``address`` unless already connected."""
        self._withdrawn.pop(address, None)
        conn = self.peers.get(address)
        if conn is None:
            conn = PeerConnection(self._zctx, address, on_change=self._on_peer_change)
            self.peers[address] = conn
            conn.start()
        self._changed.set()
        return conn

    async def close(self) -> None:
        self._closed = True
        tasks = list(self._watchers.values())
        if self._janitor is not None:
            tasks.append(self._janitor)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        self._watchers.clear()
        for conn in list(self.peers.values()):
            await conn.close()
        self.peers.clear()

    def _on_peer_change(self, conn: PeerConnection) -> None:
        self._changed.set()

    async def _watch(self, namespace: str | None) -> None:
        async for event in self._discovery.watch(namespace):
            if isinstance(event, PeerAdded):
                self.add(event.address)
            elif isinstance(event, PeerRemoved) and event.address in self.peers:
                conn = self.peers[event.address]
                if event.instance_id is None or event.instance_id in (0, conn.instance_id):
                    self._withdrawn[event.address] = time.monotonic()
                    self._changed.set()

    async def _janitor_loop(self) -> None:
        """Close peers that withdrew and have nothing in flight, or are withdrawn and down."""
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for address, since in list(self._withdrawn.items()):
                conn = self.peers.get(address)
                if conn is None:
                    del self._withdrawn[address]
                    continue
                idle = not conn._streams
                if conn.state is PeerState.DOWN or (idle and now - since > WITHDRAWN_LINGER):
                    del self._withdrawn[address]
                    del self.peers[address]
                    await conn.close()
                    self._changed.set()
