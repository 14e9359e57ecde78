"""``ReplicaSync``: KV-router replicas (frontends in kv mode, ``python -m router``) share what
they route, peer to peer, so their load estimates agree (Dynamo's router replica sync,
``--router-replica-sync``).

Each router of a model binds a PUB socket and advertises it as an endpoint of its own,
``<namespace>.kv-router.replica-<hash of model endpoint and name>`` (``replica_path``), whose
metadata names the socket; the endpoint answers a request with the replica's status. Every
other live instance of that endpoint is a peer: the router SUBs to its socket (CURVE with
``--auth-keys`` like any other socket) and applies its events (``router/_replica_wire.py``) to
its own ``LoadTracker`` and prefill counts, never to the KV index (that comes from the workers'
events). A peer's request counts until its ``FREE``, until the peer leaves discovery or liveness
(killed, partitioned), or for at most ``ttl`` seconds (a lost ``FREE``). Malformed messages are
counted and skipped; events naming a worker the router does not follow are skipped.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import xxhash
import zmq

from dynamo_zmq import errors
from dynamo_zmq.resources import Resources
from dynamo_zmq.runtime import Client, DistributedRuntime
from dynamo_zmq.transport import AsyncSocket, BadInput, make_socket, peer_key

from ._replica_metrics import ReplicaMetrics
from ._replica_wire import (
    ADD,
    FREE,
    KINDS,
    PREFILLED,
    REPLICA_TOPIC,
    REPLICA_VERSION,
    ReplicaDecodeError,
    ReplicaEvent,
    decode_event,
    encode_event,
    pack_hashes,
    unpack_hashes,
)
from .busy import PrefillTokens
from .metrics import RouterMetrics
from .scheduler import Candidate, LoadTracker, Route

__all__ = [
    "DEFAULT_REPLICA_TTL", "META_KEY", "ReplicaMetrics", "ReplicaSync", "replica_path",
    "start_replicas",
]

log = logging.getLogger(__name__)

#: Seconds a peer's request counts at most without its FREE.
DEFAULT_REPLICA_TTL = 600.0
#: The replica endpoint's metadata key.
META_KEY = "kv_router_replica"
#: Seconds between two looks at the peers when discovery signals nothing.
FOLLOW_INTERVAL = 1.0
PUB_HWM = SUB_HWM = 100_000


def replica_path(client_path: str, model: str) -> str:
    """The endpoint the replicas of ``model``'s router on ``client_path`` advertise."""
    path = client_path.removeprefix("dyn://")
    key = xxhash.xxh3_64_hexdigest(f"{path}|{model}".encode())
    return f"{path.split('.')[0]}.kv-router.replica-{key}"


async def start_replicas(sync: ReplicaSync) -> ReplicaSync | None:
    """``sync`` started; None (logged) if it cannot start: replica sync is an optimisation, a
    router without it routes alone."""
    try:
        await sync.start()
    except (errors.DynamoError, OSError, zmq.ZMQError):
        log.exception("router replica sync of %r could not start: routing without it",
                      sync.model)
        await sync.close()
        return None
    return sync


class _PeerRequest:
    __slots__ = ("at", "prefill", "route")

    def __init__(self, route: Route, prefill: tuple[Candidate, int] | None, at: float) -> None:
        self.route = route
        self.prefill = prefill
        self.at = at


class _Peer:
    """One other replica: its SUB socket and its in-flight requests."""

    def __init__(self, iid: int, endpoint: str) -> None:
        self.iid = iid
        self.endpoint = endpoint
        self.res: Resources | None = None
        self.requests: dict[int, _PeerRequest] = {}
        self.last_seq: int | None = None


class ReplicaSync:
    """Publishes one router's decisions and applies its peers'.

    Args:
        runtime: the router's runtime (serves the replica endpoint, finds the peers).
        owner: the router's resources (tasks, sockets).
        client_path, model: the model's endpoint and name (replicas of the same pair sync).
        loads, prefill: the router's load tracker and prefill counts, which peers' events feed.
        known: whether the router follows a worker instance (others' events are skipped).
        metrics: the router's metrics (the replica series join its registry).
        ttl: seconds a peer's request counts at most.
    """

    def __init__(
        self, runtime: DistributedRuntime, owner: Resources, client_path: str, model: str,
        loads: LoadTracker, prefill: PrefillTokens, known: Callable[[int], bool],
        metrics: RouterMetrics, ttl: float = DEFAULT_REPLICA_TTL,
    ) -> None:
        self._runtime = runtime
        self._res = owner.child("replica-sync")
        self.path = replica_path(client_path, model)
        self._client_path = client_path
        self._model = self.model = model
        self._loads = loads
        self._prefill = prefill
        self._known = known
        self._m = ReplicaMetrics.for_router(metrics)
        self._ttl = ttl
        self._ids = itertools.count(1)
        self._seq = 0
        self._pub: zmq.Socket[bytes] | None = None
        self._client: Client | None = None
        self._peers: dict[int, _Peer] = {}
        self._blocks: dict[Candidate, int] = {}
        self._bad = BadInput(log)
        self.endpoint = ""

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the PUB socket, advertise it and start following the peers."""
        rc = self._runtime.config
        self._pub = make_socket(self._res.zctx, zmq.PUB, bind=f"tcp://{rc.bind_host}:0",
                                hwm=PUB_HWM)
        self._res.on_close(self._close_socket)
        port = self._pub.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
        self.endpoint = f"tcp://{rc.advertised_hosts()[0]}:{port}"
        meta = {META_KEY: {"events": self.endpoint, "model": self._model,
                           "path": self._client_path}}
        endpoint = self._runtime.endpoint(self.path)
        await endpoint.start_serving(self._status, meta)
        self._res.on_close(self._withdraw)
        self._client = await endpoint.client()
        self._res.spawn(self._follow(), f"replica-sync-{self._model}")
        log.info("router replica sync for model %r on %s (%s)", self._model, self.endpoint,
                 self.path)

    async def close(self) -> None:
        await self._res.close()

    async def _withdraw(self) -> None:
        try:
            await self._runtime.remove_endpoint(self.path)
        except Exception:  # the runtime may be closing already
            log.debug("withdrawing %s failed", self.path, exc_info=True)

    def _close_socket(self) -> None:
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None

    async def _status(self, request: Any) -> AsyncIterator[dict[str, Any]]:
        """The replica endpoint's answer: what this replica counts of its peers."""
        yield self.status()

    def status(self) -> dict[str, Any]:
        return {
            "replica": f"{self._runtime.instance_id:x}",
            "model": self._model,
            "events": self.endpoint,
            "sent": self._seq,
            "peers": {f"{p.iid:x}": len(p.requests) for p in self._peers.values()},
            # The last event heard from each peer (None: none yet, its PUB may not have our
            # subscription: a SUB cannot tell when it is live, and what it misses is lost).
            "heard": {f"{p.iid:x}": p.last_seq for p in self._peers.values()},
            "blocks": {f"{w:x}/{r}": n for (w, r), n in sorted(self._blocks.items())},
        }

    # -- publishing this router's decisions --------------------------------------------------

    def added(self, route: Route, prefill_tokens: int) -> int:
        """This router routed a request (``route``): tell the peers; returns its id."""
        rid = next(self._ids)
        worker, rank = route.candidate
        self._publish(ADD, rid, worker, rank, pack_hashes(route.hashes), route.extra,
                      prefill_tokens)
        return rid

    def prefilled(self, rid: int) -> None:
        self._publish(PREFILLED, rid)

    def freed(self, rid: int) -> None:
        self._publish(FREE, rid)

    def _publish(self, kind: int, rid: int, worker: int = 0, rank: int = 0, hashes: bytes = b"",
                 extra: int = 0, prefill: int = 0) -> None:
        if self._pub is None:
            return
        ev = ReplicaEvent(REPLICA_VERSION, kind, self._runtime.instance_id, self._seq, rid,
                          worker, rank, hashes, extra, prefill)
        try:
            self._pub.send_multipart([REPLICA_TOPIC, encode_event(ev)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a full queue: peers see a gap, their TTL covers it
            self._bad.note("replica_send", "replica event not sent: %s", exc)
        self._seq += 1
        self._m.sent.labels(self._model, KINDS[kind]).inc()

    # -- following the peers -----------------------------------------------------------------

    async def _follow(self) -> None:
        while True:
            try:
                await self._runtime.wait_peers_changed(timeout=FOLLOW_INTERVAL)
                await self.sync()
            except Exception:
                log.exception("router replica sync of %r: following peers failed", self._model)
                await asyncio.sleep(FOLLOW_INTERVAL)

    async def sync(self) -> None:
        """Follow the live peers now; drop the requests of those gone and of expired ones."""
        assert self._client is not None
        live: dict[int, str] = {}
        for conn in self._client.instances():
            if conn.instance_id == self._runtime.instance_id:
                continue
            endpoint = self._advertised(conn.description)
            if endpoint is not None:
                live[conn.instance_id] = endpoint
        for iid in [i for i, p in self._peers.items() if live.get(i) != p.endpoint]:
            await self._drop_peer(self._peers.pop(iid), "peer_left")
        for iid, endpoint in live.items():
            if iid not in self._peers:
                self._add_peer(iid, endpoint)
        self._expire(time.monotonic())
        self._m.peers.labels(self._model).set(len(self._peers))
        self._update_gauges()

    def _advertised(self, desc: Any) -> str | None:
        for info in getattr(desc, "endpoints", ()):
            if info.path != self.path:
                continue
            meta = info.metadata.get(META_KEY)
            if (isinstance(meta, dict) and meta.get("model") == self._model
                    and meta.get("path") == self._client_path
                    and isinstance(meta.get("events"), str)):
                return str(meta["events"])
        return None

    def _add_peer(self, iid: int, endpoint: str) -> None:
        peer = _Peer(iid, endpoint)
        try:
            sock = make_socket(self._res.zctx, zmq.SUB, hwm=SUB_HWM, heartbeat_ms=0,
                               server_key=peer_key(iid))
        except (zmq.ZMQError, errors.CannotConnect) as exc:
            log.warning("router replica %x cannot be followed (%s)", iid, exc)
            return
        try:
            sock.setsockopt(zmq.SUBSCRIBE, REPLICA_TOPIC)
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            log.warning("router replica %x advertises %r, which cannot be connected to (%s)",
                        iid, endpoint, exc)
            return
        asock = AsyncSocket(sock)
        peer.res = res = self._res.child(f"replica {iid:x}")
        res.on_close(asock.close)
        res.spawn(self._receive(peer, asock), f"replica-{iid:x}")
        self._peers[iid] = peer
        log.info("router replica sync of %r follows replica %x at %s", self._model, iid, endpoint)

    async def _drop_peer(self, peer: _Peer, reason: str) -> None:
        if peer.res is not None:
            await peer.res.close()
        for req in list(peer.requests.values()):
            self._release(req)
        if peer.requests:
            self._m.expired.labels(self._model, reason).inc(len(peer.requests))
            log.info("router replica %x left: its %d in-flight request(s) no longer count",
                     peer.iid, len(peer.requests))
        peer.requests.clear()
        log.info("router replica sync of %r dropped replica %x", self._model, peer.iid)

    def _expire(self, now: float) -> None:
        horizon = now - self._ttl
        for peer in self._peers.values():
            old = [rid for rid, req in peer.requests.items() if req.at < horizon]
            for rid in old:
                self._release(peer.requests.pop(rid))
            if old:
                self._m.expired.labels(self._model, "ttl").inc(len(old))

    async def _receive(self, peer: _Peer, sock: AsyncSocket) -> None:
        while not sock.closed:
            frames = sock.recv_nowait()
            if frames is None:
                await sock.wait_readable()
                continue
            self.handle(peer.iid, frames)

    # -- applying the peers' events ----------------------------------------------------------

    def handle(self, iid: int, frames: list[bytes]) -> bool:
        """Apply one message from peer ``iid``; False if it was rejected. Never raises for
        anything a peer can send."""
        peer = self._peers.get(iid)
        if peer is None:
            return False
        if len(frames) != 2 or frames[0] != REPLICA_TOPIC:
            return self._reject(iid, "malformed replica message (%d frames)", len(frames))
        try:
            ev = decode_event(frames[1])
        except ReplicaDecodeError as exc:
            return self._reject(iid, "%s", exc)
        if ev.replica != iid:
            return self._reject(iid, "replica event from instance %x", ev.replica)
        if peer.last_seq is not None and ev.seq != peer.last_seq + 1:
            if ev.seq <= peer.last_seq:
                return False  # a duplicate (or a restart's, which is a new instance anyway)
            self._m.gaps.labels(self._model).inc(ev.seq - peer.last_seq - 1)
        peer.last_seq = ev.seq
        self._m.received.labels(self._model, KINDS[ev.kind]).inc()
        if ev.kind == ADD:
            self._apply_add(peer, ev)
        elif ev.kind == FREE:
            req = peer.requests.pop(ev.request, None)
            if req is not None:
                self._release(req)
        else:
            req = peer.requests.get(ev.request)
            if req is not None and req.prefill is not None:
                self._prefill.done(*req.prefill)
                req.prefill = None
        self._update_gauges()
        return True

    def _apply_add(self, peer: _Peer, ev: ReplicaEvent) -> None:
        if not self._known(ev.worker) or ev.request in peer.requests:
            return
        candidate = (ev.worker, ev.dp_rank)
        route = self._loads.add(candidate, unpack_hashes(ev.hashes), ev.extra)
        prefill = None
        if ev.prefill > 0:
            prefill = (candidate, ev.prefill)
            self._prefill.add(candidate, ev.prefill)
        peer.requests[ev.request] = _PeerRequest(route, prefill, time.monotonic())
        self._blocks[candidate] = self._blocks.get(candidate, 0) + route.size

    def _release(self, req: _PeerRequest) -> None:
        if req.prefill is not None:
            self._prefill.done(*req.prefill)
            req.prefill = None
        self._loads.release(req.route)
        candidate = req.route.candidate
        left = self._blocks.get(candidate, 0) - req.route.size
        if left > 0:
            self._blocks[candidate] = left
        else:
            self._blocks.pop(candidate, None)
            self._m.blocks.labels(self._model, f"{candidate[0]:x}", str(candidate[1])).set(0)

    def _update_gauges(self) -> None:
        m, model = self._m, self._model
        m.requests.labels(model).set(sum(len(p.requests) for p in self._peers.values()))
        for (worker, rank), blocks in self._blocks.items():
            m.blocks.labels(model, f"{worker:x}", str(rank)).set(blocks)

    def _reject(self, iid: int, msg: str, *args: object) -> bool:
        self._m.errors.labels(self._model).inc()
        self._bad.note("replica_event", "router replica %x: " + msg, iid, *args)
        return False
