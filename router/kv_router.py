"""``KvRouter``: KV-cache-aware routing of one model's requests.

It wraps the model's ``Client`` and keeps its contract (``generate``, ``instance_ids``,
``wait_for_instances``): for each request it asks the index which (worker, data-parallel rank)
already holds how much of the prompt, lets the scheduler weigh that against each candidate's
predicted load, writes the choice into ``request.routing`` (``dp_rank``, ``overlap_blocks``) and
sends the request with ``client.direct``. The returned stream releases the request's load when
it ends, however it ends.

The router follows the client's live instances: a new instance that publishes KV events gets a
``KvEventSubscriber``, and one that publishes its load (``load_endpoint`` in its metadata) a
``LoadSubscriber`` whose reports correct the predicted load (``report_load``); an instance that
leaves (discovery or liveness) has its subscribers closed and its index state and load dropped. Without KV events (``use_kv_events=False``) the
index is an ``ApproxIndexer`` fed by the router's own decisions.

``KvRouterFactory`` builds started routers for a frontend's ``ModelManager``; several frontends
(or ``python -m router``) can run side by side, each subscribing for itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import zmq

from dynamo_zmq import errors
from dynamo_zmq.context import Context
from dynamo_zmq.llm import EngineLoad, PreprocessedRequest
from dynamo_zmq.runtime import MAX_ATTEMPTS, Client
from dynamo_zmq.transport import PeerConnection

from .approx import DEFAULT_TTL, ApproxIndexer
from .hashing import block_hashes
from .indexer import KvIndexer
from .load import LoadSubscriber
from .metrics import RouterMetrics
from .routed_stream import RoutedStream
from .scheduler import REPORT_TTL, Candidate, LoadTracker, Route, Scheduler, Selection
from .subscriber import KvEventSubscriber

__all__ = ["Decision", "KvRouter", "KvRouterConfig", "KvRouterFactory", "RoutedStream"]

log = logging.getLogger(__name__)

#: Seconds between two looks at the instance set when nothing signals a change.
FOLLOW_INTERVAL = 1.0
#: Most data-parallel ranks the router considers per instance (far above real deployments).
MAX_DP_SIZE = 1024


@dataclasses.dataclass(frozen=True)
class KvRouterConfig:
    """Options of a ``KvRouter`` (Dynamo's flag names in brackets)."""

    #: Weight of blocks to prefill against decode load [--kv-overlap-score-weight].
    overlap_score_weight: float = 1.0
    #: 0: cheapest candidate; > 0: softmax sampling [--router-temperature].
    router_temperature: float = 0.0
    #: Index from the engines' KV events; False: from routing decisions [--no-kv-events].
    use_kv_events: bool = True
    #: Approximate mode: seconds a routed prefix counts as cached [--router-ttl].
    approx_ttl: float = DEFAULT_TTL
    #: Output tokens a request is expected to add to its worker's load (capped max_tokens).
    max_expected_output_tokens: int = 256
    #: Seconds a KV-event replay may take before the worker's state is dropped instead.
    replay_timeout: float = 3.0
    #: Seconds a worker's load report stays authoritative [--load-report-ttl].
    load_report_ttl: float = REPORT_TTL
    #: Requests routed less than this many seconds before a worker's load report stay counted
    #: on top of it (the engine may not have held them yet when it measured; a few of the
    #: workers' 0.1 s publish intervals) [--load-report-grace].
    load_report_grace: float = 0.3


@dataclasses.dataclass(frozen=True)
class Decision:
    """Where a request goes and why."""

    worker_id: int
    dp_rank: int
    overlap_blocks: int
    prompt_blocks: int
    #: Matched prefix blocks per candidate (only those with a match).
    matches: dict[Candidate, int]
    cost: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The ``best_worker`` answer: ids as ints, matches keyed ``"<worker hex>/<rank>"``."""
        return {
            "worker_id": self.worker_id,
            "dp_rank": self.dp_rank,
            "overlap_blocks": self.overlap_blocks,
            "prompt_blocks": self.prompt_blocks,
            "matches": {f"{w:x}/{r}": n for (w, r), n in sorted(self.matches.items())},
        }


class _Worker:
    """What the router knows of one live instance."""

    __slots__ = (
        "dp_size", "events_endpoint", "load_endpoint", "load_subscriber", "replay_endpoint", "subscriber",
    )

    def __init__(self, dp_size: int, events: str | None, replay: str | None, load: str | None) -> None:
        self.dp_size = dp_size
        self.events_endpoint = events
        self.replay_endpoint = replay
        self.load_endpoint = load
        self.subscriber: KvEventSubscriber | None = None
        self.load_subscriber: LoadSubscriber | None = None


class KvRouter:
    """Routes one model's requests to the (worker, rank) with the cheapest Dynamo cost.

    Args:
        client: the model's client (its instances are the candidates).
        block_size: the model's KV block size in tokens.
        config: the options; defaults match Dynamo's.
        metrics: shared router metrics (a private set when None).
        model: the model name (metrics label).
        runtime: the client's runtime, to wake up on peer changes (polled when None).
        zctx: the ZMQ context for subscriber sockets (a private one when None).
        scheduler: override the scheduler (tests: a seeded one).
    """

    def __init__(
        self,
        client: Client,
        block_size: int,
        config: KvRouterConfig | None = None,
        *,
        metrics: RouterMetrics | None = None,
        model: str = "",
        runtime: Any = None,
        zctx: zmq.Context[Any] | None = None,
        scheduler: Scheduler | None = None,
    ) -> None:
        if block_size < 1:
            raise errors.InvalidArgument(f"block size must be >= 1, got {block_size}")
        self.client = client
        self.path = client.path
        self.block_size = block_size
        self.config = cfg = config or KvRouterConfig()
        self.model = model
        self.metrics = metrics or RouterMetrics()
        self.scheduler = scheduler or Scheduler(cfg.overlap_score_weight, cfg.router_temperature)
        self.loads = LoadTracker(report_ttl=cfg.load_report_ttl, report_grace=cfg.load_report_grace)
        self.indexer: Any = (
            KvIndexer(block_size) if cfg.use_kv_events else ApproxIndexer(block_size, cfg.approx_ttl)
        )
        self._runtime = runtime
        self._own_zctx = zctx is None
        self._zctx = zctx if zctx is not None else zmq.Context(io_threads=1)
        self._workers: dict[int, _Worker] = {}
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    # -- the Client contract ---------------------------------------------------------------

    def instances(self) -> list[PeerConnection]:
        return self.client.instances()

    def instance_ids(self) -> list[int]:
        return self.client.instance_ids()

    async def wait_for_instances(self, timeout: float | None = None) -> list[int]:
        return await self.client.wait_for_instances(timeout)

    async def generate(
        self, request: PreprocessedRequest, context: Context | None = None, **kwargs: Any
    ) -> RoutedStream:
        """Route and send ``request``; the stream behaves like ``Client.generate``'s.

        Sets ``request.routing.dp_rank`` and ``request.routing.overlap_blocks``. A request that
        cannot reach its worker, or whose worker fails retryably before the first response, is
        routed again (excluding that worker), up to ``MAX_ATTEMPTS`` workers in all.

        Raises:
            CannotConnect: no live instance.
        """
        hashes = self._hashes(request.token_ids)
        exclude: set[int] = set()
        while True:
            decision, route = self._route(request, hashes, exclude)
            try:
                stream = await self.client.direct(request, decision.worker_id, context=context, **kwargs)
            except errors.CannotConnect:
                self.loads.release(route)
                exclude.add(decision.worker_id)
                if len(exclude) >= MAX_ATTEMPTS:
                    raise
                continue
            return RoutedStream(self, request, hashes, stream, decision, route, exclude, kwargs)

    def best_worker(self, token_ids: Sequence[int], exclude: set[int] | frozenset[int] = frozenset()) -> Decision:
        """Where ``token_ids`` would go now, without sending or counting anything.

        Raises:
            CannotConnect: no live instance (outside ``exclude``).
        """
        decision, _ = self._decide(self._hashes(token_ids), exclude)
        return decision

    def report_load(self, worker_id: int, dp_rank: int, active_blocks: float) -> None:
        """What a worker says one of its ranks holds now: replaces the router's prediction of
        the requests routed before it, for a few seconds (``LoadTracker.report``). The worker's
        ``LoadSubscriber`` calls it for every published report; a worker that publishes none
        is loaded by the router's own prediction alone."""
        self.loads.report((worker_id, dp_rank), active_blocks)

    # -- deciding --------------------------------------------------------------------------

    def _hashes(self, token_ids: Sequence[int]) -> list[int]:
        return block_hashes(token_ids, self.block_size)

    def candidates(self, exclude: set[int] | frozenset[int] = frozenset()) -> list[Candidate]:
        """Every (instance, rank) of the live instances."""
        out: list[Candidate] = []
        for conn in self.client.instances():
            iid = conn.instance_id
            if iid in exclude:
                continue
            worker = self._workers.get(iid)
            dp_size = worker.dp_size if worker is not None else _engine_info(conn, self.path)[0]
            out.extend((iid, rank) for rank in range(dp_size))
        return out

    def _decide(self, hashes: list[int], exclude: set[int] | frozenset[int]) -> tuple[Decision, Selection]:
        candidates = self.candidates(exclude)
        if not candidates:
            raise errors.CannotConnect(f"no live instance of {self.path}")
        matches = self.indexer.find_matches_for_hashes(hashes)
        sel = self.scheduler.select(candidates, len(hashes), matches, self.loads.load)
        live = set(candidates)
        decision = Decision(
            sel.worker_id, sel.dp_rank, sel.overlap_blocks, len(hashes),
            {k: v for k, v in matches.items() if v and k in live}, sel.cost,
        )
        return decision, sel

    def _route(
        self, request: PreprocessedRequest, hashes: list[int], exclude: set[int]
    ) -> tuple[Decision, Route]:
        started = time.perf_counter()
        decision, sel = self._decide(hashes, exclude)
        request.routing.dp_rank = decision.dp_rank
        request.routing.overlap_blocks = decision.overlap_blocks
        route = self.loads.add(sel.candidate, hashes, self._expected_output_blocks(request))
        if isinstance(self.indexer, ApproxIndexer):
            self.indexer.record(sel.candidate, hashes=hashes)
        m, model = self.metrics, self.model
        m.decision_latency.labels(model).observe(time.perf_counter() - started)
        m.decisions.labels(model).inc()
        if hashes:
            m.prompt_blocks.labels(model).inc(len(hashes))
            m.matched_blocks.labels(model).inc(decision.overlap_blocks)
            m.hit_rate.labels(model).observe(decision.overlap_blocks / len(hashes))
        return decision, route

    def _expected_output_blocks(self, request: PreprocessedRequest) -> int:
        cap = self.config.max_expected_output_tokens
        max_tokens = request.stop.max_tokens
        tokens = cap if max_tokens is None else min(max_tokens, cap)
        # The prompt's partial last block fills up first.
        partial = len(request.token_ids) % self.block_size
        return max(0, math.ceil((partial + tokens) / self.block_size))

    # -- following the instances -----------------------------------------------------------

    async def start(self) -> KvRouter:
        """Subscribe to the current instances and keep following them."""
        if self._task is None and not self._closed:
            await self.sync()
            self._task = asyncio.create_task(self._follow(), name=f"kv-router-{self.model or self.path}")
        return self

    async def close(self) -> None:
        """Stop following and close every subscriber (idempotent)."""
        if self._closed:
            return
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task})  # our own cancellation still propagates
        for iid in list(self._workers):
            await self._remove(iid)
        if self._own_zctx:
            self._zctx.destroy(linger=0)

    async def sync(self) -> None:
        """Bring the followed set in line with the client's live instances now."""
        live = {c.instance_id: c for c in self.client.instances()}
        for iid in [i for i in self._workers if i not in live]:
            await self._remove(iid)
        for iid, conn in live.items():
            worker = self._workers.get(iid)
            if worker is None:
                self._add(conn)
            else:
                if worker.subscriber is not None and not worker.subscriber.running:
                    log.warning("KV event subscriber of %x stopped; restarting it", iid)
                    await worker.subscriber.close()
                    self._subscribe(iid, worker)
                if worker.load_subscriber is not None and not worker.load_subscriber.running:
                    log.warning("load subscriber of %x stopped; restarting it", iid)
                    await worker.load_subscriber.close()
                    self._subscribe_load(iid, worker)
        self._update_gauges()

    def subscriber(self, worker_id: int) -> KvEventSubscriber | None:
        worker = self._workers.get(worker_id)
        return worker.subscriber if worker is not None else None

    def load_subscriber(self, worker_id: int) -> LoadSubscriber | None:
        worker = self._workers.get(worker_id)
        return worker.load_subscriber if worker is not None else None

    def followed(self) -> list[int]:
        """Instance ids the router follows now."""
        return sorted(self._workers)

    def _add(self, conn: PeerConnection) -> None:
        dp_size, events, replay, block_size = _engine_info(conn, self.path)
        if block_size and block_size != self.block_size:
            log.warning("instance %x uses KV block size %d, the router %d: its events won't match",
                        conn.instance_id, block_size, self.block_size)
        load = _load_endpoint(conn, self.path)
        worker = self._workers[conn.instance_id] = _Worker(dp_size, events, replay, load)
        if self.config.use_kv_events:
            if events:
                self._subscribe(conn.instance_id, worker)
            else:
                log.info("instance %x publishes no KV events: routed on load only", conn.instance_id)
        if load:
            self._subscribe_load(conn.instance_id, worker)
        else:
            log.info("instance %x publishes no load: its load is the router's prediction", conn.instance_id)
        log.info("router follows instance %x (%d rank%s)", conn.instance_id, dp_size, "s"[: dp_size > 1])

    def _subscribe(self, iid: int, worker: _Worker) -> None:
        assert worker.events_endpoint is not None
        sub = KvEventSubscriber(
            self._zctx, iid, worker.events_endpoint, self.indexer,
            replay_endpoint=worker.replay_endpoint, metrics=self.metrics, model=self.model,
            replay_timeout=self.config.replay_timeout,
        )
        if _started(sub, iid, "KV events", worker.events_endpoint):
            worker.subscriber = sub

    def _subscribe_load(self, iid: int, worker: _Worker) -> None:
        assert worker.load_endpoint is not None
        sub = LoadSubscriber(
            self._zctx, iid, worker.load_endpoint, self._on_load, dp_size=worker.dp_size,
            metrics=self.metrics, model=self.model,
        )
        if _started(sub, iid, "load", worker.load_endpoint):
            worker.load_subscriber = sub

    def _on_load(self, worker_id: int, ranks: list[EngineLoad]) -> None:
        if worker_id not in self._workers:  # left while the report was on its way
            return
        gauge = self.metrics.reported_blocks
        for rank in ranks:
            self.report_load(worker_id, rank.dp_rank, rank.active_blocks)
            gauge.labels(self.model, f"{worker_id:x}", str(rank.dp_rank)).set(rank.active_blocks)

    async def _remove(self, iid: int) -> None:
        worker = self._workers.pop(iid)
        # State first (no await before it): once an instance is not followed, it is not indexed
        # and reports no load.
        self.indexer.remove_worker(iid)
        self.loads.remove_worker(iid)
        if worker.load_subscriber is not None:
            await worker.load_subscriber.close()
        if worker.subscriber is not None:
            await worker.subscriber.close(drop_state=True)
        self.metrics.forget_worker(self.model, f"{iid:x}", worker.dp_size)
        log.info("router dropped instance %x", iid)

    def _update_gauges(self) -> None:
        m, model = self.metrics, self.model
        for iid, worker in self._workers.items():
            for rank in range(worker.dp_size):
                key = (iid, rank)
                m.index_blocks.labels(model, f"{iid:x}", str(rank)).set(self.indexer.num_blocks(key))
                m.active_blocks.labels(model, f"{iid:x}", str(rank)).set(self.loads.load(key))

    async def _follow(self) -> None:
        while True:
            try:
                if self._runtime is not None:
                    await self._runtime.wait_peers_changed(timeout=FOLLOW_INTERVAL)
                else:
                    await asyncio.sleep(FOLLOW_INTERVAL / 4)
                await self.sync()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("KV router of %s: following instances failed", self.path)
                await asyncio.sleep(FOLLOW_INTERVAL)


def _started(sub: KvEventSubscriber | LoadSubscriber, iid: int, what: str, endpoint: str) -> bool:
    """Start ``sub``; an endpoint a worker advertises but ZMQ cannot connect to (``tcp://*:N``,
    vLLM's bind form, is the likely one) is the worker's mistake: warn, and go on without it."""
    try:
        sub.start()
    except zmq.ZMQError as exc:
        log.warning("instance %x advertises %s at %r, which the router cannot connect to (%s): "
                    "routing it without them", iid, what, endpoint, exc)
        return False
    return True


def _engine_info(conn: PeerConnection, path: str) -> tuple[int, str | None, str | None, int]:
    """(data-parallel size, KV events endpoint, replay endpoint, block size) of an instance's
    engine, from the metadata of its endpoint ``path``."""
    desc = conn.description
    engine: dict[str, Any] = {}
    if desc is not None:
        for ep in desc.endpoints:
            if ep.path == path:
                engine = ep.metadata.get("engine") or {}
                break
    try:
        dp_size = max(1, int(engine.get("data_parallel_size") or 1))
        block_size = int(engine.get("kv_block_size") or 0)
    except (TypeError, ValueError, OverflowError):
        dp_size, block_size = 1, 0
    if dp_size > MAX_DP_SIZE:  # every rank is a candidate in every decision: bound what a peer asks
        log.warning("instance %x advertises %d data-parallel ranks; routing to its first %d",
                    conn.instance_id, dp_size, MAX_DP_SIZE)
        dp_size = MAX_DP_SIZE
    events, replay = engine.get("kv_events_endpoint"), engine.get("kv_replay_endpoint")
    return (dp_size, events if isinstance(events, str) and events else None,
            replay if isinstance(replay, str) and replay else None, block_size)


def _load_endpoint(conn: PeerConnection, path: str) -> str | None:
    """The ``load_endpoint`` a worker advertises with its endpoint ``path``, if any."""
    desc = conn.description
    if desc is not None:
        for ep in desc.endpoints:
            if ep.path == path:
                endpoint = ep.metadata.get("load_endpoint")
                return endpoint if isinstance(endpoint, str) and endpoint else None
    return None


class KvRouterFactory:
    """Builds a started ``KvRouter`` per model for a frontend's ``ModelManager``.

    Args:
        runtime: the frontend's runtime (wakes routers up on peer changes).
        config: the options every router gets.
        registry: the Prometheus registry for the router metrics (the frontend's).
    """

    def __init__(self, runtime: Any, config: KvRouterConfig, registry: Any = None) -> None:
        self.runtime = runtime
        self.config = config
        self.metrics = RouterMetrics(registry)

    async def __call__(self, client: Client, card: Any) -> KvRouter:
        """A router for ``client``; the block size comes from the model card (else from an
        instance's engine config, else 16)."""
        block_size = int(getattr(card, "kv_block_size", 0) or 0)
        if not block_size:
            for conn in client.instances():
                block_size = _engine_info(conn, client.path)[3]
                if block_size:
                    break
        router = KvRouter(
            client, block_size or 16, self.config, metrics=self.metrics,
            model=str(getattr(card, "name", "")), runtime=self.runtime,
        )
        return await router.start()
