"""``ReplicaSync``: KV-router replicas (frontends in kv mode, ``python -m router``) share what
they route, peer to peer, so their load estimates agree (Dynamo's router replica sync,
``--router-replica-sync``).

Each router of a model binds a PUB socket and advertises it as an endpoint of its own,
``<namespace>.kv-router.replica-<hash of model endpoint and name>`` (``replica_path``), whose
metadata names the socket; the endpoint answers a request with the replica's status, or with
a snapshot of its in-flight requests. Every other live instance of that endpoint is a peer: the
router SUBs to its socket (CURVE with ``--auth-keys`` like any other socket) and applies its
events (``router/_replica_wire.py``) to its own ``LoadTracker`` and prefill counts, never to the
KV index (that comes from the workers' events). It asks a new peer, one whose events show a
gap, and one with a request counted for a while, for a snapshot (``router/_replica_snapshot.py``),
so a router that joins late counts what was in flight before, and a lost ``FREE`` ends. A
peer's request counts until its ``FREE`` (or a snapshot without it), until the peer leaves
discovery or liveness (killed, partitioned), or for at most ``ttl`` seconds. Malformed messages
are counted and skipped; a request on a worker not found yet counts once it is found.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import zmq

from dynamo_zmq import errors
from dynamo_zmq.llm import SessionPins
from dynamo_zmq.resources import Resources
from dynamo_zmq.runtime import Client, DistributedRuntime
from dynamo_zmq.transport import AsyncSocket, BadInput, Domain, make_socket, peer_key

from . import _replica_snapshot as snapshots
from ._replica_metrics import ReplicaMetrics
from ._replica_publisher import ReplicaPublisher
from ._replica_sessions import SESSION_TOPIC, ReplicaPins
from ._replica_wire import (
    ADD,
    FREE,
    KINDS,
    META_KEY,
    REPLICA_TOPIC,
    ReplicaDecodeError,
    advertised_events,
    decode_event,
    replica_path,
    unpack_hashes,
)
from .busy import PrefillTokens
from .metrics import RouterMetrics
from .scheduler import Candidate, LoadTracker, Route

__all__ = ["DEFAULT_REPLICA_TTL", "META_KEY", "ReplicaMetrics", "ReplicaSync", "replica_path",
           "start_replicas"]

log = logging.getLogger(__name__)

#: Seconds a peer's request counts at most without its FREE.
DEFAULT_REPLICA_TTL = 600.0
FOLLOW_INTERVAL = 1.0  # seconds between two looks at the peers when discovery signals nothing
#: Seconds a replica waits after subscribing to a peer before asking it for a snapshot, and at
#: most for the answer.
SNAPSHOT_DELAY, SNAPSHOT_TIMEOUT = 0.2, 5.0
PUB_HWM = SUB_HWM = 100_000


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
        sessions: the router's session pins, shared with the peers (``_replica_sessions``).
    """

    def __init__(
        self, runtime: DistributedRuntime, owner: Resources, client_path: str, model: str,
        loads: LoadTracker, prefill: PrefillTokens, known: Callable[[int], bool],
        metrics: RouterMetrics, ttl: float = DEFAULT_REPLICA_TTL,
        sessions: SessionPins | None = None,
    ) -> None:
        self._runtime = runtime
        self._res = owner.child("replica-sync")
        self.path = replica_path(client_path, model)
        self._client_path, self._model, self.model = client_path, model, model
        self._loads, self._prefill, self._known = loads, prefill, known
        self._m = ReplicaMetrics.for_router(metrics)
        self._ttl, self._resync = ttl, snapshots.resync_interval(ttl)
        self._pub = ReplicaPublisher(model, self._m)
        self._pub.pins = self.pins = ReplicaPins(sessions, self._m, model)
        self._client: Client | None = None
        self._peers: dict[int, snapshots.Peer] = {}
        self._blocks: dict[Candidate, int] = {}
        self._bad, self.endpoint = BadInput(log), ""
        self.on_lora: Callable[[Candidate, str], None] | None = None  # peers' adapter requests

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the PUB socket, advertise it and start following the peers."""
        rc = self._runtime.config
        sock = make_socket(self._res.zctx, zmq.PUB, bind=f"tcp://{rc.bind_host}:0", hwm=PUB_HWM,
                           zap_domain=Domain.REPLICA)
        self._pub.sock, self._pub.replica = sock, self._runtime.instance_id
        self.pins.send, self.pins.replica = self._pub.send, self._runtime.instance_id
        self._res.on_close(self._pub.close)
        port = sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
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
        with contextlib.suppress(Exception):  # the runtime may be closing already
            await self._runtime.remove_endpoint(self.path)

    async def _status(self, request: Any) -> AsyncIterator[dict[str, Any]]:
        """The replica endpoint's answer: the status, or a snapshot (``_replica_snapshot``)."""
        if isinstance(request, dict) and request.get(snapshots.SNAPSHOT_KEY) is True:
            yield self._pub.snapshot()
        else:
            yield self.status()

    def status(self) -> dict[str, Any]:
        return {
            "replica": f"{self._runtime.instance_id:x}",
            "model": self._model,
            "events": self.endpoint,
            "sent": self._pub.seq,
            "peers": {f"{p.iid:x}": len(p.requests) for p in self._peers.values()},
            # The last event heard from each peer (None: none yet; a SUB cannot tell when live).
            "heard": {f"{p.iid:x}": p.last_seq for p in self._peers.values()},
            "blocks": {f"{w:x}/{r}": n for (w, r), n in sorted(self._blocks.items())},
        }

    # -- publishing this router's decisions (``router/_replica_publisher.py``) ---------------

    def added(self, route: Route, prefill_tokens: int, lora: str | None = None) -> int:
        """This router routed a request (``route``, adapter ``lora``): tell the peers; its id."""
        return self._pub.added(route, prefill_tokens, lora)

    def prefilled(self, rid: int) -> None:
        self._pub.prefilled(rid)

    def freed(self, rid: int) -> None:
        self._pub.freed(rid)

    # -- following the peers -----------------------------------------------------------------

    async def _follow(self) -> None:
        seen: int | None = None
        while True:
            try:
                seen = await self._runtime.wait_peers_changed(FOLLOW_INTERVAL, seen)
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
            endpoint = advertised_events(conn.description, conn.address, self.path,
                                         self._model, self._client_path)
            if endpoint is not None:
                live[conn.instance_id] = endpoint
        for iid in [i for i, p in self._peers.items() if live.get(i) != p.endpoint]:
            await self._drop_peer(self._peers.pop(iid), "peer_left")
        for iid, endpoint in live.items():
            if iid not in self._peers:
                self._add_peer(iid, endpoint)
        self.count_found()
        self._expire(time.monotonic())
        self._m.peers.labels(self._model).set(len(self._peers))
        self._update_gauges()

    def _add_peer(self, iid: int, endpoint: str) -> None:
        peer = snapshots.Peer(iid, endpoint)
        try:
            sock = make_socket(self._res.zctx, zmq.SUB, hwm=SUB_HWM, heartbeat_ms=0,
                               server_key=peer_key(iid))
        except (zmq.ZMQError, errors.CannotConnect) as exc:
            log.warning("router replica %x cannot be followed (%s)", iid, exc)
            return
        try:
            sock.setsockopt(zmq.SUBSCRIBE, REPLICA_TOPIC)
            sock.setsockopt(zmq.SUBSCRIBE, SESSION_TOPIC)
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
        self._ask_snapshot(peer)
        log.info("router replica sync of %r follows replica %x at %s", self._model, iid, endpoint)

    async def _drop_peer(self, peer: snapshots.Peer, reason: str) -> None:
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
        for peer in self._peers.values():
            old = peer.expire(now - self._ttl)
            for req in old:
                self._release(req)
            if old:
                self._m.expired.labels(self._model, "ttl").inc(len(old))
            if peer.resync_due(now, self._resync):
                self._ask_snapshot(peer)

    async def _receive(self, peer: snapshots.Peer, sock: AsyncSocket) -> None:
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
        if frames[:1] == [SESSION_TOPIC]:
            return self.pins.handle(iid, frames)
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
            self._ask_snapshot(peer)
        peer.last_seq = ev.seq
        self._m.received.labels(self._model, KINDS[ev.kind]).inc()
        if ev.kind == ADD:
            entry = (ev.worker, ev.dp_rank, ev.hashes, ev.extra, ev.prefill)
            self._count(peer, ev.request, entry, ev.seq)
            if ev.lora and self.on_lora is not None and self._known(ev.worker):
                self.on_lora((ev.worker, ev.dp_rank), ev.lora)
        elif ev.kind == FREE:
            peer.heard("free", ev.request, ev.seq)  # (a pending snapshot may still hold it)
            peer.ended(ev.request)
            req = peer.requests.pop(ev.request, None)
            if req is not None:
                self._release(req)
        else:
            peer.heard("prefilled", ev.request, ev.seq)
            peer.prefill_done(ev.request)
            req = peer.requests.get(ev.request)
            if req is not None:
                self._prefilled(req)
        self._update_gauges()
        return True

    def count_found(self) -> None:
        """Count the peers' requests that waited for a worker this router has found since."""
        for peer in self._peers.values():
            for rid, entry, seq in peer.take_known(self._known):
                self._count(peer, rid, entry, seq)

    def _count(self, peer: snapshots.Peer, rid: int, entry: snapshots.Entry, seq: int) -> None:
        """Count ``peer``'s request ``rid`` (from its ADD, or a snapshot, as of event ``seq``)."""
        worker, rank, hashes, extra, prefill_tokens = entry
        if rid in peer.requests:
            return
        if not self._known(worker):  # found by the peer first: counted once found here
            peer.wait(rid, entry, seq, time.monotonic())
            return
        candidate = (worker, rank)
        route = self._loads.add(candidate, unpack_hashes(hashes), extra)
        prefill = None
        if prefill_tokens > 0:
            prefill = (candidate, prefill_tokens)
            self._prefill.add(candidate, prefill_tokens)
        peer.requests[rid] = snapshots.PeerRequest(route, prefill, time.monotonic(), seq)
        self._blocks[candidate] = self._blocks.get(candidate, 0) + route.size

    # -- snapshots (``router/_replica_snapshot.py``) -----------------------------------------

    def _ask_snapshot(self, peer: snapshots.Peer) -> None:
        """Ask ``peer`` for a snapshot of its in-flight requests, unless one is asked for."""
        if peer.asking or peer.res is None:
            return
        peer.ask(time.monotonic())
        peer.res.spawn(self._snapshot(peer), f"replica-snapshot-{peer.iid:x}")

    async def _snapshot(self, peer: snapshots.Peer) -> None:
        assert self._client is not None
        await asyncio.sleep(SNAPSHOT_DELAY)  # the new subscription's way to the peer
        try:
            snap = await snapshots.fetch_snapshot(self._client, peer.iid, SNAPSHOT_TIMEOUT,
                                                  peer.asked_seq)
        except (errors.DynamoError, snapshots.SnapshotError) as exc:
            peer.give_up()
            self._m.snapshots.labels(self._model, "failed").inc()
            log.info("router replica %x sent no snapshot (%s): counting from its events only",
                     peer.iid, exc)
            return
        self.apply_snapshot(peer.iid, snap)

    def apply_snapshot(self, iid: int, snap: snapshots.Snapshot) -> None:
        """Reconcile what peer ``iid``'s events made this router count with its snapshot."""
        peer = self._peers.get(iid)
        if peer is None:
            return
        released, prefilled, new = peer.reconcile(snap)
        for req in released:
            self._release(req)
        for req in prefilled:
            self._prefilled(req)
        for rid, entry in new.items():
            self._count(peer, rid, entry, snap.seq)
        self.pins.learn(snap.sessions)
        if released:
            self._m.expired.labels(self._model, "snapshot").inc(len(released))
        self._m.snapshots.labels(self._model, "applied").inc()
        self._update_gauges()

    def _prefilled(self, req: snapshots.PeerRequest) -> None:
        if req.prefill is not None:
            self._prefill.done(*req.prefill)
            req.prefill = None

    def _release(self, req: snapshots.PeerRequest) -> None:
        self._prefilled(req)
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
