"""Which (worker, data-parallel rank) gets a request: Dynamo's cost, and the load it predicts.

Cost of a candidate (Dynamo's ``DefaultWorkerSelector``)::

    cost = overlap_weight * prefill_blocks + decode_blocks
    prefill_blocks = prompt_blocks - overlap_blocks     # what it would have to compute
    decode_blocks  = predicted active blocks there       # its load

The minimum wins; ties go to the lower load, then to a random one. With ``temperature > 0`` a
candidate is sampled with probability ``softmax(-(cost - min) / ((max - min) * temperature))``
(Dynamo's normalisation: the spread of costs maps to ``[-1/T, 0]``, so ``T`` means the same
whatever the scale of the costs).

Load model (``LoadTracker``): a request counts from the moment it is routed, before any KV event
can confirm it: its prompt blocks (by block hash, so requests sharing a prefix on one rank count
the shared blocks once, as the engine's prefix cache does) plus its expected output blocks. It
stops counting when its stream ends, whatever the way (terminal, error, close, garbage
collection). Workers publish what their engines hold (``dynamo_zmq.load``), and the router
passes it to ``LoadTracker.report``: a fresh report replaces the prediction of the requests routed
before it, and requests routed since are added on top; a request the report counted takes
the blocks it frees off the reported figure when it finishes. Requests routed within
``report_grace`` seconds before a report also stay on top: the engine may not have held them yet
when it measured (they were on the wire, queued, or measured a publish interval ago), and
counting one twice briefly is safer than forgetting it; when one finishes, it leaves both.

A report can also arrive after requests it counted have finished here (it was measured while
they ran, then waited on the wire or in this process's queue behind their last responses).
Given when it was measured (``measured_at``, this process's clock; ``router.load`` estimates
it), the blocks freed by releases since then leave the reported figure at once, as they would
had the report come first; otherwise a follow-up request sent at once (an agent's next turn)
would find its prefix's rank still charged with the finished one.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "Candidate",
    "LoadTracker",
    "Route",
    "Scheduler",
    "Selection",
    "cost",
    "softmax_sample",
]

#: A routing target: (worker instance id, data-parallel rank).
Candidate = tuple[int, int]

#: Seconds a worker's load report stays authoritative (workers send one at least every
#: ``dynamo_zmq.load.MAX_LOAD_INTERVAL`` seconds).
REPORT_TTL = 5.0
#: Seconds before a report in which routed requests stay counted on top of it (0: none).
REPORT_GRACE = 0.0
#: Seconds a release is remembered, to take it off reports measured before it that arrive later.
RELEASE_MEMORY = 2.0


def cost(overlap_weight: float, prompt_blocks: int, overlap_blocks: int, load: float) -> float:
    """Dynamo's cost of sending a prompt of ``prompt_blocks`` full blocks to a candidate that
    holds ``overlap_blocks`` of them and carries ``load`` active blocks."""
    return overlap_weight * max(prompt_blocks - overlap_blocks, 0) + load


def softmax_sample(costs: Sequence[float], temperature: float, sample: float) -> int:
    """Index drawn from ``costs`` (lower is likelier) with Dynamo's normalised softmax.

    Args:
        costs: one cost per candidate, at least one.
        temperature: > 0; higher spreads the choice more evenly.
        sample: a uniform number in [0, 1) (``random.random()``).
    """
    if not costs:
        raise ValueError("softmax_sample needs at least one cost")
    lo, hi = min(costs), max(costs)
    if lo == hi:
        return min(int(sample * len(costs)), len(costs) - 1)
    scale = -1.0 / ((hi - lo) * temperature)
    weights = [math.exp((c - lo) * scale) for c in costs]
    target = sample * sum(weights)
    acc = 0.0
    for i, w in enumerate(weights):
        acc += w
        if target < acc:
            return i
    return len(costs) - 1


@dataclass(frozen=True)
class Selection:
    """The scheduler's answer for one request."""

    worker_id: int
    dp_rank: int
    #: Prompt blocks already cached on the chosen candidate.
    overlap_blocks: int
    cost: float
    #: The chosen candidate's load when it was chosen.
    load: float

    @property
    def candidate(self) -> Candidate:
        return (self.worker_id, self.dp_rank)


class Scheduler:
    """Picks the cheapest candidate.

    Args:
        overlap_score_weight: weight of the blocks to prefill against the decode load; 0 routes
            on load alone.
        temperature: 0 picks the minimum; > 0 samples (see ``softmax_sample``).
        rng: the random source of ties and sampling (seed it for reproducible tests).
    """

    def __init__(
        self,
        overlap_score_weight: float = 1.0,
        temperature: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        if overlap_score_weight < 0 or not math.isfinite(overlap_score_weight):
            raise ValueError(f"overlap_score_weight must be >= 0, got {overlap_score_weight}")
        if temperature < 0 or not math.isfinite(temperature):
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.overlap_score_weight = overlap_score_weight
        self.temperature = temperature
        self._rng = rng or random.Random()

    def select(
        self,
        candidates: Sequence[Candidate],
        prompt_blocks: int,
        matches: Mapping[Candidate, int],
        load: Callable[[Candidate], float] | Sequence[float],
    ) -> Selection:
        """The candidate to use.

        Args:
            candidates: every (worker, rank) able to take the request now.
            prompt_blocks: full blocks of the prompt.
            matches: cached prefix blocks per candidate (missing: 0).
            load: predicted active blocks of a candidate, or of each candidate in order.

        Raises:
            ValueError: no candidates.
        """
        if not candidates:
            raise ValueError("no candidates to route to")
        w = self.overlap_score_weight
        loads = [load(c) for c in candidates] if callable(load) else list(load)
        overlaps = [min(matches.get(c, 0), prompt_blocks) for c in candidates]
        costs = [cost(w, prompt_blocks, o, ld) for o, ld in zip(overlaps, loads, strict=True)]
        if self.temperature > 0:
            i = softmax_sample(costs, self.temperature, self._rng.random())
        else:
            best = min(costs)
            tied = [i for i, c in enumerate(costs) if c == best]
            if len(tied) > 1:
                least = min(loads[i] for i in tied)
                tied = [i for i in tied if loads[i] == least]
            i = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        worker_id, dp_rank = candidates[i]
        return Selection(worker_id, dp_rank, overlaps[i], costs[i], loads[i])


class Route:
    """One routed request's share of a candidate's load (see ``LoadTracker.add``)."""

    __slots__ = (
        "_state", "candidate", "carried", "epoch", "extra", "hashes", "released", "routed_at",
        "size",
    )

    def __init__(
        self,
        candidate: Candidate,
        hashes: tuple[int, ...],
        extra: int,
        state: _Load,
        routed_at: float,
    ) -> None:
        self.candidate = candidate
        self.hashes = hashes
        self.extra = extra
        self._state = state
        #: The report epoch the route counts in ``since_report`` for (see ``LoadTracker.report``).
        self.epoch = state.epoch
        #: Kept on top of a report that may have counted it (routed within its grace).
        self.carried = False
        self.size = len(hashes) + extra
        self.released = False
        self.routed_at = routed_at


class _Load:
    __slots__ = (
        "blocks", "epoch", "extra", "freed", "recent", "reported", "reported_at", "since_report",
        "total",
    )

    def __init__(self) -> None:
        self.blocks: Counter[int] = Counter()  # prompt block hash -> active requests holding it
        self.extra = 0  # expected output blocks of active requests
        self.epoch = 0  # bumped by each report
        self.reported = 0.0
        self.reported_at = -math.inf
        self.since_report = 0  # blocks of requests routed after the last report, still active
        self.recent: deque[Route] = deque()  # routes of the last grace period, oldest first
        self.freed: deque[tuple[float, int]] = deque()  # (when, blocks) of recent releases
        self.total = 0  # the rank's KV blocks in all, from its reports (0: unknown)


def _held(state: _Load, now: float, ttl: float) -> float:
    """A fresh report plus what was routed since, else the prediction alone."""
    if now - state.reported_at <= ttl:
        return state.reported + state.since_report
    return float(len(state.blocks) + state.extra)


def _forget_releases(state: _Load, now: float) -> None:
    freed, horizon = state.freed, now - RELEASE_MEMORY
    while freed and freed[0][0] < horizon:
        freed.popleft()


class LoadTracker:
    """Predicted active KV blocks per candidate: routing decisions, corrected by workers' reports.

    Args:
        report_ttl: seconds a ``report`` stays authoritative.
        report_grace: requests routed less than this many seconds before a report stay counted
            on top of it (the module docstring says why).
        clock: monotonic time source.
    """

    def __init__(
        self,
        report_ttl: float = REPORT_TTL,
        clock: Callable[[], float] = time.monotonic,
        report_grace: float = REPORT_GRACE,
    ) -> None:
        self._loads: dict[Candidate, _Load] = {}
        self._report_ttl = report_ttl
        self._report_grace = report_grace
        self._clock = clock
        #: Called after a release and after a report (load may have dropped; the router's wait
        #: queue looks again). None: nothing.
        self.on_change: Callable[[], object] | None = None

    @property
    def report_ttl(self) -> float:
        """Seconds a report stays authoritative."""
        return self._report_ttl

    @property
    def report_grace(self) -> float:
        """Seconds before a report in which routed requests stay counted on top of it."""
        return self._report_grace

    def add(
        self, candidate: Candidate, block_hashes: Iterable[int], extra_blocks: int = 0
    ) -> Route:
        """Count a request routed to ``candidate`` now: its prompt blocks (deduplicated against
        the other active requests there) and ``extra_blocks`` (expected output)."""
        state = self._loads.get(candidate)
        if state is None:
            state = self._loads[candidate] = _Load()
        hashes = tuple(block_hashes)
        state.blocks.update(hashes)
        state.extra += extra_blocks
        now = self._clock()
        route = Route(candidate, hashes, extra_blocks, state, now)
        state.since_report += route.size
        if self._report_grace > 0:
            self._forget_old(state, now)
            state.recent.append(route)
        return route

    def release(self, route: Route) -> None:
        """The request finished: stop counting it (idempotent)."""
        if route.released:
            return
        route.released = True
        state = route._state
        if self._loads.get(route.candidate) is not state:  # its worker was removed meanwhile
            return
        blocks = state.blocks
        freed = route.extra  # what the engine frees: output blocks and unshared prompt blocks
        for h in route.hashes:
            n = blocks[h] - 1
            if n > 0:
                blocks[h] = n
            else:
                del blocks[h]
                freed += 1
        state.extra -= route.extra
        if freed:
            now = self._clock()
            _forget_releases(state, now)
            state.freed.append((now, freed))
        if route.epoch == state.epoch:
            state.since_report -= route.size
        if route.epoch != state.epoch or route.carried:
            # The last report counted it (or may have); it holds nothing now. Without this the
            # report would keep the finished request's blocks until the next one, and a
            # follow-up request (the next turn of a conversation) would be steered off the rank
            # caching its prefix.
            state.reported = max(0.0, state.reported - freed)
        if self.on_change is not None:
            self.on_change()

    def load(self, candidate: Candidate) -> float:
        """Predicted active blocks of ``candidate`` (0 when nothing is known)."""
        state = self._loads.get(candidate)
        return 0.0 if state is None else _held(state, self._clock(), self._report_ttl)

    def report(
        self,
        candidate: Candidate,
        active_blocks: float,
        measured_at: float | None = None,
        total_blocks: int = 0,
    ) -> None:
        """What the worker says it holds now (its published load): replaces the prediction of
        the requests routed before, except those of the last ``report_grace`` seconds, for
        ``report_ttl`` seconds.

        Args:
            measured_at: when the worker read the figure, on this tracker's clock (None:
                unknown, taken as now). Blocks released here since then are taken off it.
            total_blocks: the rank's KV blocks in all (0: unknown, the last known is kept).
        """
        state = self._loads.get(candidate)
        if state is None:
            state = self._loads[candidate] = _Load()
        now = self._clock()
        if measured_at is not None:
            _forget_releases(state, now)
            for released_at, blocks in reversed(state.freed):
                if released_at <= measured_at:
                    break
                active_blocks -= blocks
        if total_blocks > 0:
            state.total = total_blocks
        state.reported = max(0.0, float(active_blocks))
        state.reported_at = now
        state.epoch += 1
        state.since_report = 0
        self._forget_old(state, now)
        for route in state.recent:  # still on top: they move to the new epoch
            if not route.released:
                route.epoch = state.epoch
                route.carried = True
                state.since_report += route.size
        if self.on_change is not None:
            self.on_change()

    def loads_of(self, candidates: Iterable[Candidate]) -> list[float]:
        """``load`` of each candidate, read at one moment (one clock read for them all: a
        decision among 256 workers asks for every one)."""
        now, ttl, get = self._clock(), self._report_ttl, self._loads.get
        return [0.0 if (st := get(c)) is None else _held(st, now, ttl) for c in candidates]

    def total_blocks(self, candidate: Candidate) -> int:
        """The candidate's KV blocks in all, as its last report said (0: unknown)."""
        state = self._loads.get(candidate)
        return 0 if state is None else state.total

    def _forget_old(self, state: _Load, now: float) -> None:
        recent, horizon = state.recent, now - self._report_grace
        while recent and (recent[0].routed_at < horizon or recent[0].released):
            recent.popleft()

    def active_blocks(self, candidate: Candidate) -> Mapping[int, int] | None:
        """Prompt block hash -> active requests holding it on ``candidate`` (None: none known).
        Read only: ``router._inflight`` extends index matches with it."""
        state = self._loads.get(candidate)
        return None if state is None else state.blocks

    def prompt_blocks(self, candidate: Candidate) -> int:
        """Distinct prompt blocks counted for ``candidate`` (for tests)."""
        state = self._loads.get(candidate)
        return 0 if state is None else len(state.blocks)

    def remove_worker(self, worker_id: int) -> None:
        """Forget every rank of ``worker_id``; its outstanding routes release as no-ops."""
        for key in [k for k in self._loads if k[0] == worker_id]:
            del self._loads[key]

    def candidates(self) -> list[Candidate]:
        return list(self._loads)
