"""``KvRouter``: KV-cache-aware routing of one model's requests (a ``ModelRouter``).

For each request it asks the index which (worker, data-parallel rank) already holds how much of
the prompt, lets the scheduler weigh that against each candidate's predicted load, writes the
choice into ``request.routing`` (``dp_rank``, ``overlap_blocks``) and sends the request to that
worker alone. The request's predicted load is held until the engine's terminal output, or until
its stream is done with however it ends (an error, ``aclose``, or being dropped unread). A
worker that cannot be reached, or that fails retryably before its first output, gets the
request re-routed to the next best (worker, rank), excluding it, up to ``MAX_ATTEMPTS`` workers
in all.

Which instances it routes to, and what it subscribes to for each, is ``InstanceFollower``'s
job. Without KV events (``use_kv_events=False``, the approximate mode) the index is an
``ApproxIndexer`` fed by the router's own decisions.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence

from dynamo_zmq import errors
from dynamo_zmq.context import Context
from dynamo_zmq.llm import (
    DEFAULT_ROUTE,
    DecodeRemotely,
    LLMEngineOutput,
    MediaItem,
    OutputStream,
    PrefillRemotely,
    PreprocessedRequest,
    RouteOptions,
    SessionPins,
)
from dynamo_zmq.resources import Resources
from dynamo_zmq.runtime import MAX_ATTEMPTS, Client, DistributedRuntime, failover
from dynamo_zmq.transport import PeerConnection, ResponseStream, item_decoder
from dynamo_zmq.wire import encode_item

from ._decision import Decision
from ._inflight import with_inflight
from ._lora_residency import LoraResidency
from ._session_route import record_pin, select_pinned
from ._sizes import expected_output_blocks, prefill_tokens
from .approx import ApproxIndexer
from .busy import AdmissionQueue, BusyPolicy, PrefillTokens
from .config import KvRouterConfig, kv_indexer
from .following import MAX_DP_SIZE, InstanceFollower
from .hashing import request_hashes
from .indexer import KvIndexer
from .load import LoadSubscriber
from .metrics import RouterMetrics
from .placement import AllBusy, Placement
from .replica_sync import ReplicaSync, start_replicas
from .scheduler import Candidate, LoadTracker, Route, Scheduler, Selection
from .subscriber import KvEventSubscriber

__all__ = ["MAX_DP_SIZE", "Decision", "KvRouter", "KvRouterConfig"]

_decode_output = item_decoder(LLMEngineOutput)

log = logging.getLogger(__name__)


def _remote_decode(request: PreprocessedRequest) -> bool:
    return isinstance(request.disaggregation, DecodeRemotely)


class KvRouter:
    """Routes one model's requests to the (worker, rank) with the cheapest Dynamo cost.

    Args:
        client: the model's client (its instances are the candidates).
        block_size: the model's KV block size in tokens.
        config: the options; defaults match Dynamo's.
        metrics: shared router metrics (a private set when None).
        model: the model name (metrics label).
        runtime: the client's runtime: wakes the router on peer changes, and owns its tasks
            and sockets (polled, with resources of its own, when None).
        scheduler: override the scheduler (tests: a seeded one).
        sessions: the session pins (``RouteOptions.session_id``); None: sessions are not pinned.
    """

    def __init__(
        self,
        client: Client,
        block_size: int,
        config: KvRouterConfig | None = None,
        *,
        metrics: RouterMetrics | None = None,
        model: str = "",
        runtime: DistributedRuntime | None = None,
        scheduler: Scheduler | None = None,
        sessions: SessionPins | None = None,
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
        self.busy = BusyPolicy(cfg.busy_kv_threshold, cfg.busy_prefill_tokens)
        self.sessions = sessions if sessions is not None and sessions.enabled else None
        self._prefill_weight = cfg.prefill_load_weight
        self._inflight = cfg.use_kv_events and cfg.inflight_overlap
        #: Track each request's prompt tokens until its first output (busy rule, prefill load).
        self._track_prefill = cfg.busy_prefill_tokens > 0 or cfg.prefill_load_weight > 0
        self.prefill = PrefillTokens()
        self.queue = AdmissionQueue(
            cfg.busy_queue_size, cfg.busy_queue_timeout, self.metrics, model
        )
        if self.busy.enabled:
            self.loads.on_change = self.queue.notify
        self.indexer: KvIndexer | ApproxIndexer = (
            kv_indexer(block_size, cfg.index_max_blocks, cfg.index_layout)
            if cfg.use_kv_events
            else ApproxIndexer(block_size, cfg.approx_ttl)
        )
        if cfg.use_kv_events:
            log.info("kv-router %s: KV index in the %s layout", model or self.path,
                     cfg.index_layout)
        name = f"kv-router {model or self.path}"
        self._res = runtime.resources.child(name) if runtime is not None else Resources(name)
        self._follower = InstanceFollower(
            client, self._res, self.indexer, cfg.use_kv_events, self.loads, self.metrics, model,
            block_size, cfg.replay_timeout, runtime,
        )
        self._res.on_close(self._follower.close)  # after the follow task is cancelled
        #: The LoRA adapters predicted resident per (worker, rank) (``--kv-lora-miss-blocks``).
        self.residency = LoraResidency(cfg.lora_miss_blocks, self._follower.max_loras)
        self._follower.on_remove = self.residency.remove_worker
        #: Router replica sync (``--router-replica-sync``): peers' decisions feed ``loads``.
        self.replicas = (
            ReplicaSync(runtime, self._res, client.path, model, self.loads, self.prefill,
                        self._follows, self.metrics, cfg.replica_ttl, self.sessions)
            if cfg.replica_sync and runtime is not None else None
        )
        self._started = False

    # -- the ModelRouter interface ---------------------------------------------------------

    def instance_ids(self) -> list[int]:
        return self.client.instance_ids()

    async def generate(
        self,
        request: PreprocessedRequest,
        context: Context | None = None,
        options: RouteOptions = DEFAULT_ROUTE,
    ) -> OutputStream:
        """Route and send ``request``; its outputs stream back, decoded.

        Sets ``request.routing.dp_rank`` and ``request.routing.overlap_blocks`` (again on each
        re-route). ``options.instance_id`` is not read: the router chooses.
        ``options.exclude``: workers not to send to, not even on a re-route (a migrated
        request's lost workers); ``options.only``: the only workers it may go to, re-routes
        included (a LoRA adapter's holders). A request with ``lora_name`` is matched by hashes
        chained from the adapter's root (never credited by the base's or another adapter's
        blocks). ``options.session_id``: the session's pinned (worker, rank) is taken while it
        is live, allowed and not busy. While every rank is busy it waits in ``queue``.

        Raises:
            CannotConnect: no live instance could take the request.
            Overloaded: every (worker, rank) stayed busy past the wait queue's bounds.
        """
        hashes = self._hashes(request.token_ids, request.lora_name, request.media)
        placement = Placement(self.loads, self.prefill, self.replicas)
        exclude = options.exclude
        admit = self.busy.enabled
        my_turn = not self.queue
        deadline = None if options.timeout is None else time.monotonic() + options.timeout
        while True:
            if my_turn:
                try:
                    first = await self._send(
                        request, hashes, exclude, placement, context, options, admit
                    )
                    break
                except AllBusy:
                    if _remote_decode(request):  # a disaggregated prefill: prefilled locally
                        raise errors.Overloaded("every prefill worker is busy") from None
            await self.queue.admit(lambda: self._any_free(exclude, options.only), context,
                                   request.priority, deadline)
            my_turn = True
        ctx = first.context  # not ``first``: the hook must not keep the stream alive

        async def reopen(tried: frozenset[int]) -> ResponseStream[LLMEngineOutput] | None:
            try:
                return await self._send(
                    request, hashes, tried, placement, ctx, options
                )
            except errors.CannotConnect:
                return None

        # The load is released once: at the engine's terminal output, or when the stream is
        # done with however it ends (even dropped unread); a re-route moves it to the new
        # attempt's (worker, rank).
        if self._track_prefill:
            placement.stream = weakref.ref(first)
            first.set_on_item(placement.on_first_output)
        else:
            first.set_on_item(placement.on_output)
        first.set_on_release(placement.release)
        return failover(first, reopen, exclude)

    async def close(self) -> None:
        """Stop following and close every subscriber (idempotent)."""
        await self._res.close()
        if self.sessions is not None:
            self.sessions.clear()

    # -- deciding --------------------------------------------------------------------------

    def best_worker(
        self, token_ids: Sequence[int], exclude: set[int] | frozenset[int] = frozenset(),
        lora_name: str | None = None,
    ) -> Decision:
        """Where ``token_ids`` (under LoRA adapter ``lora_name``) would go now, without
        sending or counting anything.

        Raises:
            CannotConnect: no live instance (outside ``exclude``).
        """
        decision, _ = self._decide(self._hashes(token_ids, lora_name), exclude, lora=lora_name)
        return decision

    def report_load(self, worker_id: int, dp_rank: int, active_blocks: float) -> None:
        """What a worker says one of its ranks holds now: replaces the router's prediction of
        the requests routed before it, for a few seconds (``LoadTracker.report``)."""
        self.loads.report((worker_id, dp_rank), active_blocks)

    def candidates(
        self, exclude: set[int] | frozenset[int] = frozenset(), only: frozenset[int] | None = None
    ) -> list[Candidate]:
        """Every (instance, rank) of the live instances (made once per change of the pool),
        outside ``exclude`` and, given ``only``, among those (``InstanceFollower``)."""
        return self._follower.candidates(exclude, only)

    async def _send(
        self,
        request: PreprocessedRequest,
        hashes: list[int],
        tried: frozenset[int],
        placement: Placement,
        context: Context | None,
        options: RouteOptions,
        admit: bool = False,
    ) -> ResponseStream[LLMEngineOutput]:
        """Route and send one attempt, moving on from workers that cannot be reached
        (``options``: the request's deadline, idle timeout and excluded workers, which are in
        ``tried`` but count as no attempt; ``admit``: raise ``AllBusy`` rather than route to a
        busy rank)."""
        exclude = set(tried)
        while True:
            decision, route = self._route(request, hashes, exclude, admit, options)
            try:
                stream = await self.client.open(
                    encode_item(request), _decode_output, decision.worker_id, context=context,
                    timeout=options.timeout, idle_timeout=options.idle_timeout,
                    trace_attributes={"overlap_blocks": decision.overlap_blocks,
                                      "dp_rank": decision.dp_rank, "blocks": len(hashes)},
                )
            except errors.CannotConnect:
                self.loads.release(route)
                exclude.add(decision.worker_id)
                if len(exclude - options.exclude) >= MAX_ATTEMPTS:
                    raise
                continue
            placement.hold(route, self._prefill_tokens(request, decision), request.lora_name)
            return stream

    def _hashes(self, token_ids: Sequence[int], lora: str | None = None,
                media: list[MediaItem] | None = None) -> list[int]:
        return request_hashes(token_ids, self.block_size, lora, media)

    def _prefill_tokens(self, request: PreprocessedRequest, decision: Decision) -> int:
        if not self._track_prefill:
            return 0
        return prefill_tokens(request, decision.overlap_blocks, self.block_size)

    def _any_free(self, exclude: frozenset[int], only: frozenset[int] | None = None) -> bool:
        """Whether some live (worker, rank) outside ``exclude`` (among ``only``) is not busy."""
        busy, loads, prefill = self.busy.is_busy, self.loads, self.prefill
        return any(not busy(c, loads, prefill) for c in self.candidates(exclude, only))

    def _decide(
        self,
        hashes: list[int],
        exclude: set[int] | frozenset[int],
        overlap: bool = True,
        admit: bool = False,
        pinned: Candidate | None = None,
        only: frozenset[int] | None = None,
        lora: str | None = None,
    ) -> tuple[Decision, Selection]:
        candidates = self.candidates(exclude, only)
        if not candidates:
            among = "" if only is None else " among those holding the request's LoRA adapter"
            raise errors.CannotConnect(f"no live instance of {self.path}{among}")
        values = self.loads.loads_of(candidates)
        if self.busy.enabled:  # busy ranks take nothing while another can
            busy, loads, prefill = self.busy.is_busy, self.loads, self.prefill
            free = [i for i, c in enumerate(candidates) if not busy(c, loads, prefill, values[i])]
            if not free and admit:
                raise AllBusy
            if free and len(free) < len(candidates):
                candidates, values = [candidates[i] for i in free], [values[i] for i in free]
        if (w := self._prefill_weight) > 0:  # plus the weighted blocks still to prefill there
            values = [v + w * self.prefill.get(c) / self.block_size
                      for c, v in zip(candidates, values, strict=True)]
        if (misses := self.residency.penalties(candidates, lora)) is not None:
            values = [v + m for v, m in zip(values, misses, strict=True)]  # adapter loads
        matches = self.indexer.find_matches_for_hashes(hashes) if overlap else {}
        if overlap and self._inflight:  # what the events cannot say yet (router/_inflight.py)
            matches = with_inflight(matches, hashes, candidates, self.loads)
        sel = select_pinned(self.scheduler, candidates, len(hashes), matches, values, pinned)
        live = set(candidates)
        if overlap and hashes and len(candidates) > 1:
            flat = not any(matches.get(c) for c in candidates)
            self._follower.diagnostics.note_decision(flat, self.indexer)
        decision = Decision(
            sel.worker_id, sel.dp_rank, sel.overlap_blocks, len(hashes),
            {k: v for k, v in matches.items() if v and k in live}, sel.cost,
        )
        return decision, sel

    def _route(
        self, request: PreprocessedRequest, hashes: list[int], exclude: set[int],
        admit: bool = False, options: RouteOptions = DEFAULT_ROUTE,
    ) -> tuple[Decision, Route]:
        started, cpu = time.perf_counter(), time.thread_time()
        # A decode worker that pulls the prompt's KV from a prefill worker (disaggregation)
        # prefills nothing: cached blocks earn it no credit, it is chosen by load.
        remote = isinstance(request.disaggregation, PrefillRemotely)
        pins, session, only = self.sessions, options.session_id, options.only
        pinned = pins.get(session) if pins is not None else None
        decision, sel = self._decide(hashes, exclude, not remote, admit, pinned, only,
                                     request.lora_name)
        self.residency.routed(sel.candidate, request.lora_name)
        record_pin(pins, self.replicas, session, pinned, sel.candidate,
                   lambda: pinned in self.candidates(exclude, only))
        request.routing.dp_rank = decision.dp_rank
        request.routing.overlap_blocks = decision.overlap_blocks
        expected = expected_output_blocks(
            request, self.block_size, self.config.max_expected_output_tokens
        )
        route = self.loads.add(sel.candidate, hashes, expected)
        if hashes:
            self._follower.diagnostics.note_routed(sel.worker_id)
        if isinstance(self.indexer, ApproxIndexer):
            self.indexer.record(sel.candidate, hashes=hashes)
        self.metrics.decided(self.model, time.perf_counter() - started, time.thread_time() - cpu,
                             len(hashes), decision.overlap_blocks)
        return decision, route

    # -- following the instances -----------------------------------------------------------

    async def start(self) -> KvRouter:
        """Subscribe to the current instances and keep following them."""
        if not self._started and not self._res.closed:
            self._started = True
            await self._follower.sync()
            self._follower.start()
            if self.replicas is not None:
                self.replicas.on_lora = self.residency.routed  # peers' adapter requests
                self.replicas = await start_replicas(self.replicas)
        return self

    def _follows(self, worker_id: int) -> bool:
        return worker_id in self.client.instance_ids()

    async def sync(self) -> None:
        """Bring the followed set in line with the client's live instances now."""
        await self._follower.sync()

    def followed(self) -> list[int]:
        """Instance ids the router follows now."""
        return self._follower.followed()

    def subscriber(self, worker_id: int) -> KvEventSubscriber | None:
        return self._follower.subscriber(worker_id)

    def load_subscriber(self, worker_id: int) -> LoadSubscriber | None:
        return self._follower.load_subscriber(worker_id)

    def instances(self) -> list[PeerConnection]:
        return self.client.instances()

    async def wait_for_instances(self, timeout: float | None = None) -> list[int]:
        return await self.client.wait_for_instances(timeout)
