"""``InstanceFollower``: the KV router's view of which instances serve its model, and what it
subscribes to for each.

It follows a client's live instances: a new instance that publishes KV events gets a
``KvEventSubscriber`` (into the router's index), one that publishes its load a
``LoadSubscriber`` (into the router's load tracker); an instance that leaves (discovery or
liveness) has its subscribers closed and its index state and load dropped. What an instance
publishes comes from its ``ModelAdvert``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import zmq

from dynamo_zmq import errors
from dynamo_zmq.llm import EngineLoad, ModelAdvert, advert_of
from dynamo_zmq.llm._block_hashing import FORM_DELTAS
from dynamo_zmq.resources import Resources
from dynamo_zmq.runtime import Client, DistributedRuntime
from dynamo_zmq.transport import PeerConnection

from ._lora_residency import max_loras_of
from .approx import ApproxIndexer
from .diagnostics import Diagnostics
from .indexer import KvIndexer
from .load import LoadSubscriber
from .metrics import RouterMetrics
from .scheduler import Candidate, LoadTracker
from .subscriber import KvEventSubscriber

__all__ = ["FOLLOW_INTERVAL", "MAX_DP_SIZE", "InstanceFollower"]

log = logging.getLogger(__name__)

#: Seconds between two looks at the instance set when nothing signals a change (a look costs
#: a pass over every instance: at 256 workers not worth doing every second for nothing).
FOLLOW_INTERVAL = 5.0
#: Most data-parallel ranks the router considers per instance (far above real deployments).
MAX_DP_SIZE = 1024


class _Instance:
    """What the router knows of one live instance."""

    __slots__ = ("advert", "dp_size", "load_subscriber", "reported", "subscriber")

    def __init__(self, advert: ModelAdvert | None, dp_size: int) -> None:
        self.advert = advert
        self.dp_size = dp_size
        self.subscriber: KvEventSubscriber | None = None
        self.load_subscriber: LoadSubscriber | None = None
        #: Its ``reported_blocks`` gauge per rank, looked up once.
        self.reported: dict[int, Any] = {}


class InstanceFollower:
    """Subscriptions of one router, one set per live instance of ``client``.

    Args:
        client: the model's client (its instances are followed).
        resources: owns the follow task; its ZMQ context makes the subscriber sockets.
        indexer: the router's index (a leaving instance's state is dropped from it).
        events: subscribe to the instances' KV events into ``indexer`` (False: approximate
            mode, the index is fed by the router's own decisions).
        loads: where load reports go.
        metrics, model: the router's metrics and their label.
        block_size: the router's block size (an instance using another one is warned about).
        replay_timeout: seconds a KV-event replay may take.
        runtime: wakes the follower on peer changes (polled when None).
    """

    def __init__(
        self,
        client: Client,
        resources: Resources,
        indexer: KvIndexer | ApproxIndexer,
        events: bool,
        loads: LoadTracker,
        metrics: RouterMetrics,
        model: str,
        block_size: int,
        replay_timeout: float,
        runtime: DistributedRuntime | None = None,
    ) -> None:
        self.client = client
        self._res = resources
        self._indexer = indexer
        self._events = events
        self._loads = loads
        self._metrics = metrics
        self._model = model
        self._block_size = block_size
        self._replay_timeout = replay_timeout
        self._runtime = runtime
        self._instances: dict[int, _Instance] = {}
        #: The router's self-checks (block size, silent workers, flat scores).
        self.diagnostics = Diagnostics(metrics, model, block_size, events)
        self._evicted = 0  # the index's evictions already counted in the metric
        #: ``candidates()`` as of the client's generation.
        self._candidates: tuple[int, list[Candidate]] | None = None
        #: Called with an instance's id once it is dropped (the router's other per-worker state).
        self.on_remove: Callable[[int], None] | None = None

    def start(self) -> None:
        self._res.spawn(self._follow(), f"kv-router-{self._model or self.client.path}")

    async def close(self) -> None:
        """Close every subscriber and forget every instance (the owner stops the task)."""
        for iid in list(self._instances):
            await self._remove(iid)

    def followed(self) -> list[int]:
        return sorted(self._instances)

    def dp_size(self, conn: PeerConnection) -> int:
        """The data-parallel ranks the router considers for ``conn``'s instance."""
        known = self._instances.get(conn.instance_id)
        if known is not None:
            return known.dp_size
        return _dp_size(advert_of(conn, self.client.path), conn.instance_id)

    def max_loras(self, worker_id: int) -> int:
        """LoRA adapters ``worker_id`` keeps resident per rank (its advert's; unknown: 1)."""
        known = self._instances.get(worker_id)
        advert = known.advert if known is not None else None
        return max_loras_of(advert.engine.extra) if advert is not None else 1

    def candidates(
        self, exclude: set[int] | frozenset[int] = frozenset(), only: frozenset[int] | None = None
    ) -> list[Candidate]:
        """Every (instance, rank) of the live instances (made once per change of the pool),
        outside ``exclude`` and, given ``only``, among those."""
        gen = self.client.generation
        if self._candidates is None or self._candidates[0] != gen:
            out: list[Candidate] = []
            for conn in self.client.instances():
                out.extend((conn.instance_id, r) for r in range(self.dp_size(conn)))
            self._candidates = (gen, out)
        found = self._candidates[1]
        if only is not None:
            return [c for c in found if c[0] in only and c[0] not in exclude]
        return [c for c in found if c[0] not in exclude] if exclude else list(found)

    def subscriber(self, worker_id: int) -> KvEventSubscriber | None:
        known = self._instances.get(worker_id)
        return known.subscriber if known is not None else None

    def load_subscriber(self, worker_id: int) -> LoadSubscriber | None:
        known = self._instances.get(worker_id)
        return known.load_subscriber if known is not None else None

    async def sync(self) -> None:
        """Bring the followed set in line with the client's live instances now."""
        # Silent ones too: an instance out of routing for a moment keeps its index state.
        live = {c.instance_id: c for c in self.client.instances(silent=True)}
        for iid in [i for i in self._instances if i not in live]:
            await self._remove(iid)
        for iid, conn in live.items():
            known = self._instances.get(iid)
            if known is None:
                self._add(conn)
                continue
            if known.subscriber is not None and not known.subscriber.running:
                log.warning("KV event subscriber of %x stopped; restarting it", iid)
                await known.subscriber.close()
                self._subscribe_events(iid, known)
            if known.load_subscriber is not None and not known.load_subscriber.running:
                log.warning("load subscriber of %x stopped; restarting it", iid)
                await known.load_subscriber.close()
                self._subscribe_load(iid, known)
        self._update_gauges()

    def _add(self, conn: PeerConnection) -> None:
        iid = conn.instance_id
        advert = advert_of(conn, self.client.path)
        dp_size = _dp_size(advert, iid)
        self.diagnostics.check_advert(iid, advert)
        known = self._instances[iid] = _Instance(advert, dp_size)
        if self._events:
            if advert is not None and advert.kv_events_endpoint:
                self._subscribe_events(iid, known)
        if advert is not None and advert.load_endpoint:
            self._subscribe_load(iid, known)
        else:
            log.info("instance %x publishes no load: its load is the router's prediction", iid)
        log.info("router follows instance %x (%d rank%s)", iid, dp_size, "s"[: dp_size > 1])

    def _subscribe_events(self, iid: int, known: _Instance) -> None:
        assert known.advert is not None and known.advert.kv_events_endpoint is not None
        assert isinstance(self._indexer, KvIndexer)  # events are followed only into one
        endpoint = known.advert.kv_events_endpoint
        scheme = known.advert.engine.kv_hash_scheme
        edge = scheme is not None and scheme.usable_by(self._block_size)  # else: diagnostics
        sub = KvEventSubscriber(
            self._res, iid, endpoint, self._indexer,
            replay_endpoint=known.advert.kv_replay_endpoint, metrics=self._metrics,
            model=self._model, replay_timeout=self._replay_timeout, edge_hashed=edge,
            deltas=scheme is not None and scheme.form == FORM_DELTAS,
        )
        if _started(sub, iid, "KV events", endpoint):
            known.subscriber = sub

    def _subscribe_load(self, iid: int, known: _Instance) -> None:
        assert known.advert is not None and known.advert.load_endpoint is not None
        endpoint = known.advert.load_endpoint
        sub = LoadSubscriber(
            self._res, iid, endpoint, self._on_load, dp_size=known.dp_size,
            metrics=self._metrics, model=self._model,
        )
        if _started(sub, iid, "load", endpoint):
            known.load_subscriber = sub

    def _on_load(
        self, worker_id: int, ranks: list[EngineLoad], measured_at: float | None
    ) -> None:
        known = self._instances.get(worker_id)
        if known is None:  # left while the report was on its way
            return
        for rank in ranks:
            self._loads.report(
                (worker_id, rank.dp_rank), rank.active_blocks, measured_at, rank.total_blocks
            )
            gauge = known.reported.get(rank.dp_rank)
            if gauge is None:
                gauge = known.reported[rank.dp_rank] = self._metrics.reported_blocks.labels(
                    self._model, f"{worker_id:x}", str(rank.dp_rank))
            gauge.set(rank.active_blocks)

    async def _remove(self, iid: int) -> None:
        known = self._instances.pop(iid)
        # State first (no await before it): once an instance is not followed, it is not indexed
        # and reports no load.
        self._indexer.remove_worker(iid)
        self._loads.remove_worker(iid)
        if self.on_remove is not None:
            self.on_remove(iid)
        if known.load_subscriber is not None:
            await known.load_subscriber.close()
        if known.subscriber is not None:
            await known.subscriber.close(drop_state=True)
        self._metrics.forget_worker(self._model, f"{iid:x}", known.dp_size)
        self.diagnostics.forget(iid)
        log.info("router dropped instance %x", iid)

    def _update_gauges(self) -> None:
        diag = self.diagnostics
        diag.check_index(self._indexer)
        diag.check_silent((i, k.advert, k.subscriber) for i, k in self._instances.items())
        diag.update_gauges()
        m, model = self._metrics, self._model
        for iid, known in self._instances.items():
            for rank in range(known.dp_size):
                key = (iid, rank)
                blocks = self._indexer.num_blocks(key)
                m.index_blocks.labels(model, f"{iid:x}", str(rank)).set(blocks)
                m.active_blocks.labels(model, f"{iid:x}", str(rank)).set(self._loads.load(key))
        if isinstance(self._indexer, KvIndexer):
            m.index_size.labels(model).set(self._indexer.num_blocks())
            evicted = self._indexer.stats.evicted
            m.index_evicted.labels(model).inc(evicted - self._evicted)
            self._evicted = evicted

    async def _follow(self) -> None:
        seen: int | None = None
        while True:
            try:
                if self._runtime is not None:
                    seen = await self._runtime.wait_peers_changed(FOLLOW_INTERVAL, seen)
                else:
                    await asyncio.sleep(0.25)  # nothing signals a change: look often
                await self.sync()
            except Exception:
                log.exception("KV router of %s: following instances failed", self.client.path)
                await asyncio.sleep(FOLLOW_INTERVAL)


def _dp_size(advert: ModelAdvert | None, iid: int) -> int:
    """An instance's data-parallel size, bounded: every rank is a candidate in every decision,
    so what a peer claims must not size the router's work."""
    dp_size = advert.data_parallel_size if advert is not None else 1
    if dp_size > MAX_DP_SIZE:
        log.warning("instance %x advertises %d data-parallel ranks; routing to its first %d",
                    iid, dp_size, MAX_DP_SIZE)
        dp_size = MAX_DP_SIZE
    return dp_size


def _started(sub: KvEventSubscriber | LoadSubscriber, iid: int, what: str, endpoint: str) -> bool:
    """Start ``sub``; an endpoint a worker advertises but ZMQ cannot connect to (``tcp://*:N``,
    vLLM's bind form, is the likely one) is the worker's mistake: warn, and go on without it."""
    try:
        sub.start()
    except (zmq.ZMQError, errors.CannotConnect) as exc:  # CannotConnect: its key (auth on)
        log.warning("instance %x advertises %s at %r, which the router cannot connect to (%s): "
                    "routing it without them", iid, what, endpoint, exc)
        return False
    return True
