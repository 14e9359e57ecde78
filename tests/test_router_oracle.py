"""router.oracle: the finite-capacity bound is at least what online policies reach in the same
simulator, at most the infinite-cache bound, and equal to it when capacity is unbounded."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from router.oracle import BALANCES, block_keys, finite_bound, infinite_bound, simulate

# A request: a path in a small prefix tree (each step picks one of 3 children).
_paths = st.lists(st.integers(0, 2), max_size=6)
_traces = st.lists(_paths, min_size=1, max_size=14)


def _keys(paths: list[list[int]]) -> list[list[int]]:
    return block_keys([[1 + c for c in p] for p in paths], 1)


@settings(max_examples=300, deadline=None)
@given(_traces, st.integers(1, 3), st.integers(1, 8), st.sampled_from([None, 1.0, 1.5]))
def test_finite_bound_beats_online_policies(
    paths: list[list[int]], workers: int, capacity: int, slack: float | None
) -> None:
    reqs = _keys(paths)
    bound = finite_bound(reqs, workers, capacity, window=4, slack=slack)
    for placement in ("round-robin", "greedy", "approx"):
        for balance in BALANCES:
            online = simulate(reqs, workers, capacity, placement, "lru", window=4, slack=slack,
                              balance=balance)
            assert bound.hits >= online.hits
            assert online.blocks == bound.blocks
    assert bound.rate <= infinite_bound(reqs) + 1e-12


@settings(max_examples=200, deadline=None)
@given(_traces, st.integers(1, 4))
def test_unbounded_capacity_reaches_the_infinite_bound(
    paths: list[list[int]], workers: int
) -> None:
    reqs = _keys(paths)
    inf = infinite_bound(reqs)
    assert simulate(reqs, workers, math.inf, "greedy", "belady", slack=None).rate == inf
    assert finite_bound(reqs, workers, math.inf, slack=None).rate == inf
    assert finite_bound(reqs, 1, math.inf).rate == inf
    # With nothing evicted, what was sent to a worker is what it holds: approx is greedy.
    greedy = simulate(reqs, workers, math.inf, "greedy", "lru", slack=None)
    approx = simulate(reqs, workers, math.inf, "approx", "lru", slack=None)
    assert approx.placement == greedy.placement and approx.hits == greedy.hits


def test_capacity_and_placement_matter() -> None:
    # Two prefixes of 3 blocks, alternating: one worker of 3 blocks thrashes; two keep both.
    a, b = [1, 2, 3], [4, 5, 6]
    reqs = block_keys([a, b] * 4, 1)
    assert simulate(reqs, 1, 3, "greedy", "lru").hits == 0
    # LRU drops the prefix that comes back; the clairvoyant eviction drops the one that does not.
    once = block_keys([[1, 2], [3, 4], [5, 6], [1, 2]], 1)
    assert simulate(once, 1, 4, "greedy", "lru").hits == 0
    assert simulate(once, 1, 4, "greedy", "belady").hits == 2
    two = finite_bound(reqs, 2, 3, window=2, slack=1.0)
    assert two.hits == infinite_bound(reqs) * two.blocks == 18
    assert simulate(reqs, 2, 3, "round-robin", "lru").hits == 18


def test_block_keys_are_chained() -> None:
    keys = block_keys([[1, 2, 3, 4], [1, 2, 9, 9], [3, 4, 1, 2]], 2)
    assert keys[0][0] == keys[1][0] and keys[0][1] != keys[1][1]
    assert keys[2][0] != keys[0][1]  # equal tokens, different prefix
    assert block_keys([[1, 2, 3]], 2) == [[0]]  # the partial last block is not a key


@settings(max_examples=200, deadline=None)
@given(_traces, _traces, st.integers(1, 3), st.integers(1, 8), st.sampled_from([None, 1.5]))
def test_warm_up_requests_fill_caches_but_are_not_counted(
    warm_paths: list[list[int]], paths: list[list[int]], workers: int, capacity: int,
    slack: float | None,
) -> None:
    warm = len(warm_paths)
    reqs = _keys(warm_paths + paths)
    window = reqs[warm:]
    blocks = sum(map(len, window))
    # The measured part counts only the window's blocks, and the warm cache can only add hits
    # to the infinite bound.
    assert infinite_bound(reqs, warm) >= infinite_bound(window) - 1e-12
    assert infinite_bound(reqs, warm) <= 1.0
    bound = finite_bound(reqs, workers, capacity, window=4, slack=slack, measure_from=warm)
    assert bound.blocks == blocks
    assert bound.rate <= infinite_bound(reqs, warm) + 1e-12
    for placement in ("round-robin", "greedy"):
        online = simulate(reqs, workers, capacity, placement, "lru", 4, slack, warm)
        assert online.blocks == blocks and bound.hits >= online.hits
    # measure_from=0 is the whole trace, as before.
    assert finite_bound(reqs, workers, capacity, 4, slack, 0).hits == finite_bound(
        reqs, workers, capacity, window=4, slack=slack).hits


def test_a_warm_cache_turns_a_cold_window_into_hits() -> None:
    reqs = block_keys([[1, 2, 3], [4, 5, 6], [1, 2, 3], [4, 5, 6]], 1)
    assert infinite_bound(reqs[2:]) == 0.0  # alone, the window has no reuse
    assert infinite_bound(reqs, measure_from=2) == 1.0
    assert finite_bound(reqs, 2, 3, window=2, slack=1.0, measure_from=2).hits == 6
    assert simulate(reqs, 1, 3, "greedy", "lru", measure_from=2).hits == 0  # it thrashes


def test_approx_sends_a_prefix_back_to_the_cache_that_evicted_it() -> None:
    # Worker 0 evicts [2] for [1, 2]. Approx still believes worker 0 holds [2] and sends [2, 3]
    # there, which evicts [1]; greedy sees the eviction, sends [2, 3] to the idler worker 1,
    # and the last [1] hits on worker 0.
    reqs = block_keys([[2], [3], [1, 2], [2, 3], [1]], 1)
    greedy = simulate(reqs, 2, 2, "greedy", "lru", slack=None)
    approx = simulate(reqs, 2, 2, "approx", "lru", slack=None)
    assert greedy.placement == [0, 1, 0, 1, 0] and approx.placement == [0, 1, 0, 0, 0]
    assert (greedy.hits, approx.hits) == (1, 0)


def test_a_balance_term_stops_greedy_leaving_a_worker_idle() -> None:
    # Every request shares its first block. Without a balance term the worker holding it wins
    # every request (the other never matches), so one cache of 3 blocks thrashes on three
    # families; with one, the second worker takes families too and they hit.
    fams = [[0, 1, 2], [0, 3, 4], [0, 5, 6]]
    reqs = block_keys(fams * 4, 1)
    lone = simulate(reqs, 2, 4, "greedy", "lru", slack=None)
    assert set(lone.placement) == {0}
    balanced = simulate(reqs, 2, 4, "greedy", "lru", slack=None, balance=1.0)
    assert set(balanced.placement) == {0, 1} and balanced.hits > lone.hits
    assert finite_bound(reqs, 2, 4, slack=None).hits >= balanced.hits
