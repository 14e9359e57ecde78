"""The set of remote instances this process knows, fed by discovery, kept honest by liveness.

Discovery says where peers might be; a ``PeerConnection`` to each address finds out who is
there and whether it is alive. ``PeerPool`` answers "which live instances serve endpoint E" and
lets callers wait for that answer to change.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ..discovery import Discovery, PeerAdded, PeerRemoved
from ..resources import Resources, wait_event
from ..transport import (
    SERVING,
    CurveAuth,
    CurveRefused,
    PeerConnection,
    PeerState,
    PingTicker,
    current_curve,
    format_roles,
)

__all__ = ["PeerPool"]

log = logging.getLogger(__name__)

#: A withdrawn (cleanly unregistered) peer with no open streams is closed after this long.
WITHDRAWN_LINGER = 2.0
#: Refused adverts remembered (each logged once); past this many, more are refused silently.
MAX_REFUSED = 1024


class PeerPool:
    """Connections to every discovered peer, keyed by address.

    Args:
        resources: owns the pool's tasks and its connections (children of a child of it).
        discovery: where peers are learned from (started by the caller).
    """

    def __init__(self, resources: Resources, discovery: Discovery) -> None:
        self._res = resources.child("peers")
        self._discovery = discovery
        #: One task pings every connection of the pool.
        self._pings = PingTicker(self._res)
        self.peers: dict[str, PeerConnection] = {}
        #: What discovery said about each address when it was last announced (mDNS: namespace,
        #: instance id, components; a static list: nothing but the address).
        self.hints: dict[str, PeerAdded] = {}
        self._withdrawn: dict[str, float] = {}
        #: (address, key) adverts refused for their key (auth on), each logged once.
        self._refused: set[tuple[str, bytes | None]] = set()
        #: The latest refused advert's key per address, retried when the authorized set changes.
        self._refused_adverts: dict[str, bytes | None] = {}
        self._watching: set[str | None] = set()
        #: Addresses of connections that went DOWN: one answering again tells discovery.
        self._lost: set[str] = set()
        self._changed = asyncio.Event()
        #: Counts the changes (``wait_changed``); every change of a peer's state, description,
        #: draining flag or withdrawal bumps it.
        self.generation = 0
        #: ``instances(path)`` as of a generation.
        self._instances: dict[str, tuple[int, list[PeerConnection]]] = {}
        self._closed = False
        #: The authorized set's generation last seen (auth on): a change may change who serves.
        self._trust = 0

    def watch(self, namespace: str | None) -> None:
        """Follow discovery for ``namespace`` (idempotent)."""
        if self._closed or namespace in self._watching or None in self._watching:
            return
        if not self._watching:
            self._res.spawn(self._janitor_loop(), "peer-janitor")
        self._watching.add(namespace)
        self._res.spawn(self._watch(namespace), f"discovery-watch-{namespace}")

    def instances(self, path: str) -> list[PeerConnection]:
        """Routable connections serving endpoint ``path``, one per instance id, by instance id
        (worked out once per generation: routers ask for every request)."""
        cached = self._instances.get(path)
        if cached is not None and cached[0] == self.generation:
            return list(cached[1])
        by_id: dict[int, PeerConnection] = {}
        for conn in self.peers.values():
            desc = conn.description
            if not conn.routable or desc is None or conn.address in self._withdrawn:
                continue
            if any(ep.path == path for ep in desc.endpoints):
                by_id.setdefault(desc.instance_id, conn)
        found = [by_id[i] for i in sorted(by_id)]
        self._instances[path] = (self.generation, found)
        return list(found)

    async def wait_changed(self, timeout: float | None = None, since: int | None = None) -> int:
        """Wait for the next change of any peer (or the timeout); with ``since`` (a generation
        this returned before), return at once if a change came after it. Returns the
        generation now: a caller that passes it back misses no change made while it was busy."""
        if since is not None and since != self.generation:
            return self.generation
        await wait_event(self._changed, timeout)  # never loses a cancellation (a closing owner)
        return self.generation

    def _signal(self) -> None:
        """A peer changed: wake every waiter (each waits on the event of its generation)."""
        self.generation += 1
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    def add(self, address: str, key: bytes | None = None) -> PeerConnection | None:
        """Connect to ``address`` unless already connected. With auth on, only with its
        advertised CURVE ``key`` and only if that key is authorized: else None, said once."""
        self._withdrawn.pop(address, None)
        conn = self.peers.get(address)
        if conn is None:
            try:
                _check_serves(key)
                conn = PeerConnection(
                    self._res, address, on_change=self._on_peer_change, server_key=key,
                    ticker=self._pings,
                )
                conn.start()
            except CurveRefused as exc:
                if len(self._refused_adverts) < MAX_REFUSED:
                    self._refused_adverts[address] = key  # accepted once its key is authorized
                if (address, key) not in self._refused and len(self._refused) < MAX_REFUSED:
                    self._refused.add((address, key))
                    hint = self.hints.get(address)
                    iid = f"instance {hint.instance_id:x} at " if hint and hint.instance_id else ""
                    log.warning("not connecting to %s%s: %s (a spoofed or unauthorized advert)",
                                iid, address, exc.message)
                return None
            self.peers[address] = conn
        self._refused_adverts.pop(address, None)
        self._signal()
        return conn

    async def close(self) -> None:
        """Stop following discovery and close every connection (idempotent)."""
        self._closed = True
        await self._res.close()  # watchers, janitor, then each connection (newest first)
        for conn in list(self.peers.values()):
            await conn.close()  # already closed by the above; marks them CLOSED for callers
        self.peers.clear()
        self.hints.clear()

    def _on_peer_change(self, conn: PeerConnection) -> None:
        self._signal()
        if conn.state is PeerState.DOWN:
            self._lost.add(conn.address)
        elif conn.state is PeerState.READY and conn.address in self._lost:
            self._lost.discard(conn.address)
            self._discovery.refresh()  # a link may have healed: peers missed meanwhile

    async def _watch(self, namespace: str | None) -> None:
        async for event in self._discovery.watch(namespace):
            if isinstance(event, PeerAdded):
                self.hints[event.address] = event
                self.add(event.address, event.key)
            elif isinstance(event, PeerRemoved) and event.address in self._refused_adverts:
                del self._refused_adverts[event.address]
            elif isinstance(event, PeerRemoved) and event.address in self.peers:
                conn = self.peers[event.address]
                if event.stale and conn.state in (PeerState.READY, PeerState.SILENT):
                    continue  # its record is old, but it answers: liveness is ours
                if event.instance_id is None or event.instance_id in (0, conn.instance_id):
                    self._withdrawn[event.address] = time.monotonic()
                    self._signal()

    async def _janitor_loop(self) -> None:
        """Close peers that withdrew and have nothing in flight, or are withdrawn and down;
        with auth on, follow changes of the authorized set."""
        while True:
            await asyncio.sleep(0.5)
            if (curve := current_curve()) is not None:
                await self._recheck_keys(curve)
            now = time.monotonic()
            for address, since in list(self._withdrawn.items()):
                conn = self.peers.get(address)
                if conn is None:
                    del self._withdrawn[address]
                    continue
                idle = not conn.open_streams
                if conn.state is PeerState.DOWN or (idle and now - since > WITHDRAWN_LINGER):
                    del self._withdrawn[address]
                    del self.peers[address]
                    self.hints.pop(address, None)
                    self._lost.discard(address)
                    await conn.close()
                    self._signal()

    async def _recheck_keys(self, curve: CurveAuth) -> None:
        """Connect to refused adverts whose key is now authorized; drop connections whose key
        was revoked (their streams end with ``Disconnected``; nothing new is routed there)."""
        if curve.generation != self._trust:
            self._trust = curve.generation
            self._signal()  # a key's roles may have changed what its instance may serve
        for address, key in list(self._refused_adverts.items()):
            if key is not None and curve.roles_of(key) & SERVING:
                log.info("the key of %s is authorized now: connecting", address)
                self.add(address, key)
        for address, conn in list(self.peers.items()):
            if conn.server_key is not None and not curve.roles_of(conn.server_key) & SERVING:
                log.warning("the key of %r was revoked (or holds only roles that serve "
                            "nothing): disconnecting", conn)
                del self.peers[address]
                self._withdrawn.pop(address, None)
                self._lost.discard(address)
                self._refused_adverts[address] = conn.server_key
                await conn.close()
                self._signal()


def _check_serves(key: bytes | None) -> None:
    """Refuse an advert whose key (auth on) is authorized but only as a ``tool``: tools call,
    they never serve, so such an advert is a stolen tool key's.

    Raises:
        CurveRefused: it is.
    """
    curve = current_curve()
    if curve is None or key is None or not curve.is_authorized(key):
        return  # auth off, or PeerConnection refuses an unauthorized key itself
    roles = curve.roles_of(key)
    if not roles & SERVING:
        raise CurveRefused(f"its key {curve.name_of(key)} holds only {format_roles(roles)}, "
                           "which serves nothing")
