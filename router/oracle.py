"""Offline bounds on the prefix hit rate a router can reach on a trace (for benchmarks).

A trace is a list of requests, each the list of its full KV blocks' chained keys (equal key =
equal prefix up to and including that block). A request on a worker hits the longest prefix of
its keys that the worker holds; the hit rate is hits / all full blocks.

- ``infinite_bound``: one cache of unbounded size (a block hits if any earlier request had it).
- ``simulate``: N workers with caches of ``capacity`` blocks, one placement policy and one
  eviction policy, under a balance rule: no worker takes more than
  ``ceil(slack * window / workers)`` of any ``window`` consecutive requests.
- ``finite_bound``: the best of several runs, most of them knowing the whole trace. It is a
  **heuristic oracle**, not a proven optimum (placing prefixes optimally is NP-hard in
  general): a greedy placement that sends each request to the worker where it hits most
  (less ``balance`` blocks per request the worker took in the window; ties: the fewest such
  requests) while every cache evicts by Belady's rule (farthest next use anywhere in the trace
  first, deeper blocks first on ties, so caches stay prefix-closed); and round-robin, that
  greedy placement and the approximate placement (greedy on what was sent to each worker, as a
  router without KV events) with LRU caches or Belady's rule, the greedy and approximate ones
  with ``balance`` 0, 0.25 and 1. Greedy with Belady's rule alone is not always best (on
  random tiny traces it lost to an online run about once in 500), hence the maximum. Without
  a balance term greedy can leave a worker idle: when every request shares a first block, a
  worker that never got one never matches, so the others win every tie until the window's cap
  stops them (the conversation trace's warm window lost 3 points of bound that way before the
  balanced candidates joined). It
  ignores what a real engine also spends cache on (blocks of running requests, generated
  tokens), so real engines sit below it even with a perfect router.

Each takes ``measure_from``: requests before that index warm the caches (they are placed,
admitted and evicted as usual) but their blocks are not counted, as when a benchmark replays a
trace's earlier rows before the window it measures.
"""

from __future__ import annotations

import collections
import heapq
import math
from collections.abc import Container, Sequence
from dataclasses import dataclass, field

__all__ = [
    "BALANCES",
    "PLACEMENTS",
    "SimResult",
    "block_keys",
    "finite_bound",
    "infinite_bound",
    "simulate",
]

PLACEMENTS = ("round-robin", "greedy", "approx")
#: The balance terms the oracle tries (blocks of hit one request in the window is worth).
BALANCES = (0.0, 0.25, 1.0)
_INF = math.inf


def block_keys(prompts: Sequence[Sequence[int]], block_size: int) -> list[list[int]]:
    """Chained keys of each prompt's full blocks: equal keys mean equal prefixes."""
    ids: dict[tuple[int, tuple[int, ...]], int] = {}
    out: list[list[int]] = []
    for p in prompts:
        keys: list[int] = []
        parent = -1
        for i in range(len(p) // block_size):
            k = (parent, tuple(p[i * block_size : (i + 1) * block_size]))
            parent = ids.setdefault(k, len(ids))
            keys.append(parent)
        out.append(keys)
    return out


def infinite_bound(reqs: Sequence[Sequence[int]], measure_from: int = 0) -> float:
    """Hit rate with one unbounded cache: blocks whose prefix appeared in an earlier request
    (counted from request ``measure_from`` on; earlier ones only fill the cache)."""
    seen: set[int] = set()
    hit = tot = 0
    for i, keys in enumerate(reqs):
        if i >= measure_from:
            hit += sum(k in seen for k in keys)
            tot += len(keys)
        seen.update(keys)
    return hit / tot if tot else 0.0


@dataclass
class SimResult:
    """Hits and blocks of one simulated run, and the worker each request went to."""

    hits: int
    blocks: int
    placement: list[int] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.hits / self.blocks if self.blocks else 0.0


class _Cache:
    """One worker's cache of ``capacity`` blocks, evicting LRU or by farthest next use."""

    def __init__(self, capacity: float, belady: bool) -> None:
        self.capacity = capacity
        self.belady = belady
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.next_use: dict[int, float] = {}
        self.depth: dict[int, int] = {}
        self.heap: list[tuple[float, int, int]] = []  # (-next use, -depth, key), lazy

    def __contains__(self, key: object) -> bool:
        return key in self.next_use if self.belady else key in self.lru

    def match(self, keys: Sequence[int]) -> int:
        return _prefix_len(self, keys)

    def admit(self, keys: Sequence[int], nexts: Sequence[float]) -> None:
        """Touch or insert the request's blocks (at most ``capacity`` of them)."""
        if len(keys) > self.capacity:
            keys, nexts = keys[: int(self.capacity)], nexts[: int(self.capacity)]
        pinned = set(keys)
        if self.belady:
            for d, (k, nu) in enumerate(zip(keys, nexts, strict=True)):
                if k not in self.next_use:
                    self._evict_belady(pinned)
                self.next_use[k] = nu
                self.depth[k] = d
                heapq.heappush(self.heap, (-nu, -d, k))
            return
        for k in keys:  # the request's cached blocks first, so that inserting spares them
            if k in self.lru:
                self.lru.move_to_end(k)
        for k in keys:
            if k not in self.lru:
                while len(self.lru) >= self.capacity:
                    self.lru.popitem(last=False)
                self.lru[k] = None
        for k in reversed(keys):  # parents most recent: children leave first
            self.lru.move_to_end(k)

    def _evict_belady(self, pinned: set[int]) -> None:
        if len(self.next_use) < self.capacity:
            return
        kept: list[tuple[float, int, int]] = []
        while self.heap:
            item = heapq.heappop(self.heap)
            neg_nu, neg_d, k = item
            if self.next_use.get(k) != -neg_nu or self.depth.get(k) != -neg_d:
                continue  # stale entry
            if k in pinned:
                kept.append(item)
                continue
            del self.next_use[k], self.depth[k]
            break
        for item in kept:
            heapq.heappush(self.heap, item)


def _next_uses(reqs: Sequence[Sequence[int]]) -> list[list[float]]:
    """For each request's block, the index of the next request that holds it (inf: none)."""
    last: dict[int, float] = {}
    out: list[list[float]] = [[] for _ in reqs]
    for i in range(len(reqs) - 1, -1, -1):
        out[i] = [last.get(k, _INF) for k in reqs[i]]
        for k in reqs[i]:
            last[k] = i
    return out


def simulate(
    reqs: Sequence[Sequence[int]],
    workers: int,
    capacity: float,
    placement: str = "greedy",
    eviction: str = "belady",
    window: int = 32,
    slack: float | None = 1.5,
    measure_from: int = 0,
    balance: float = 0.0,
) -> SimResult:
    """Replay ``reqs`` on ``workers`` caches of ``capacity`` blocks (``math.inf``: unbounded).

    placement: ``round-robin``, or ``greedy``: the worker whose cache holds the longest prefix
    of the request, less ``balance`` blocks for each request it took in the window (ties:
    fewest requests in the window, then the lowest index), like a KV router that sees every
    event and weighs load; or ``approx``: the same choice made on what was sent to each
    worker instead of what its cache holds (a router without KV events, whose belief never
    expires and never learns of an eviction). eviction: ``lru``, or ``belady`` (clairvoyant:
    farthest next use first). Greedy with Belady eviction is the oracle's main candidate.
    slack: the balance rule's factor, None for no rule. measure_from: the first request whose
    hits and blocks count (earlier ones only warm the caches).
    """
    if workers < 1 or not capacity >= 1:
        raise ValueError("workers and capacity must be >= 1")
    if placement not in PLACEMENTS or eviction not in ("lru", "belady"):
        raise ValueError(f"unknown placement {placement!r} or eviction {eviction!r}")
    caches = [_Cache(capacity, eviction == "belady") for _ in range(workers)]
    nexts = _next_uses(reqs)
    cap = math.ceil(slack * window / workers) if slack is not None else None
    recent: collections.deque[int] = collections.deque()
    counts = [0] * workers
    sent: list[set[int]] = [set() for _ in range(workers)]  # approx's belief
    res = SimResult(0, 0)
    for i, keys in enumerate(reqs):
        allowed = [w for w in range(workers) if cap is None or counts[w] < cap]
        if placement == "round-robin":
            w = i % workers
        elif placement == "approx":
            w = max(allowed, key=lambda c: (
                _prefix_len(sent[c], keys) - balance * counts[c], -counts[c], -c))
            sent[w].update(keys)
        else:
            w = max(allowed, key=lambda c: (
                caches[c].match(keys) - balance * counts[c], -counts[c], -c))
        if i >= measure_from:
            res.hits += caches[w].match(keys)
            res.blocks += len(keys)
        res.placement.append(w)
        caches[w].admit(keys, nexts[i])
        recent.append(w)
        counts[w] += 1
        if len(recent) > window - 1:  # the next request's window holds window - 1 others
            counts[recent.popleft()] -= 1
    return res


def _prefix_len(held: Container[int], keys: Sequence[int]) -> int:
    """How many of ``keys``, from the first, are in ``held``."""
    n = 0
    for k in keys:
        if k not in held:
            break
        n += 1
    return n


def finite_bound(
    reqs: Sequence[Sequence[int]],
    workers: int,
    capacity: float,
    window: int = 32,
    slack: float | None = 1.5,
    measure_from: int = 0,
) -> SimResult:
    """The best hit rate of the heuristic oracle's candidate runs (see the module docstring)."""
    runs = [simulate(reqs, workers, capacity, p, e, window, slack, measure_from, b)
            for p in PLACEMENTS for e in ("belady", "lru")
            for b in (BALANCES if p != "round-robin" else (0.0,))]
    return max(runs, key=lambda r: r.hits)
