"""Batches of edge-hashed stores applied at once by ``PackedKvIndexer`` (``router._batch_store``)
build exactly the index that applying their events one by one builds: same entries in the same
insertion order (what eviction walks), same masks, same counters, same matches. Batches mix
independent stores, stores chaining from an earlier event of the batch, re-stores, shared
prefixes across keys and stores past the cap, so both the batched path and its fallback run."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router._packed_indexer import PackedKvIndexer as KvIndexer
from router.events import BlockRemoved, BlockStored, EventBatch, KvEvent
from router.hashing import block_hashes

SIZE = 2
ENGINE_XOR = 0x5555_AAAA_0F0F_F0F0


@st.composite
def workloads(draw: st.DrawFn) -> tuple[list[tuple[int, list[KvEvent]]], list[list[int]]]:
    """(worker, batch) pairs and prompts to query."""
    vocab = draw(st.sampled_from([3, 1000]))  # shared prefixes, or mostly independent chains
    prompts = draw(st.lists(st.lists(st.integers(0, vocab), min_size=SIZE, max_size=10 * SIZE),
                            min_size=1, max_size=6))
    chains = []
    for p in prompts:
        own = block_hashes(p, SIZE)
        chains.append(([h ^ ENGINE_XOR for h in own], own))
    fresh = draw(st.booleans())
    progress = [0] * len(chains)
    batches: list[tuple[int, list[KvEvent]]] = []
    stored: list[int] = []
    for _ in range(draw(st.integers(1, 12))):
        worker = 0 if fresh else draw(st.integers(0, 2))
        if stored and draw(st.integers(0, 4)) == 0:
            batches.append((worker, [BlockRemoved(draw(st.lists(st.sampled_from(stored),
                                                                 max_size=6)))]))
            continue
        events: list[KvEvent] = []
        for _ in range(draw(st.integers(1, 6))):
            i = draw(st.integers(0, len(chains) - 1))
            eng, own = chains[i]
            if fresh:  # the prompt's next blocks: its parent held, or stored just before
                a = progress[i]
                if a >= len(eng):
                    continue
                b = progress[i] = draw(st.integers(a + 1, len(eng)))
            else:  # any part of it: re-stores, unknown parents
                a = draw(st.integers(0, len(eng) - 1))
                b = draw(st.integers(a + 1, len(eng)))
            events.append(BlockStored(eng[a:b], eng[a - 1] if a else None, [], SIZE,
                                      own_hashes=own[a:b]))
            stored += eng[a:b]
        batches.append((worker, events))
    return batches, prompts


def _state(idx: KvIndexer) -> object:
    # The masks' front counts a twin (``shared``) when it is merged (router._masks): compare
    # settled states. (Each E2OTable's front is part of its items, in insertion order.)
    idx._packed_masks.merge()
    keys = sorted(idx.keys())
    return ([(k, list(idx._state[k].e2o.items()), dict(idx._state[k].dups),
              dict(idx._state[k].shared), idx._state[k].orphans) for k in keys],
            sorted(idx._masks.table.items()), idx.num_blocks(), idx.stats)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.sampled_from([10_000, 12, 5]))
def test_batched_stores_build_the_index_that_one_by_one_stores_build(workload, cap) -> None:
    batches, prompts = workload
    batched = KvIndexer(SIZE, cap, evict_oldest=cap == 12)
    single = KvIndexer(SIZE, cap, evict_oldest=cap == 12)
    for worker, events in batches:
        batched.apply_batch(worker, EventBatch(1.0, events))
        for ev in events:
            single.apply_batch(worker, EventBatch(1.0, [ev]))
        assert _state(batched) == _state(single)
    for p in prompts:
        for k in range(SIZE, len(p) + 1, SIZE):
            assert batched.find_matches(p[:k]) == single.find_matches(p[:k])


def test_independent_stores_take_the_batched_path() -> None:
    """Two roots and a store under an already held parent: applied together."""
    a, b = block_hashes([1, 2, 3, 4], SIZE), block_hashes([5, 6, 7, 8, 9, 9], SIZE)
    idx = KvIndexer(SIZE)
    idx.apply_batch(0, EventBatch(1.0, [BlockStored([10], None, [], SIZE, own_hashes=a[:1])]))
    batch = [BlockStored([11], 10, [], SIZE, own_hashes=a[1:]),
             BlockStored([20, 21, 22], None, [], SIZE, own_hashes=b)]
    from router._batch_store import store_batch as batch_store

    def store_batch(idx: KvIndexer, key: tuple[int, int], events: list[KvEvent]) -> bool:
        ks = idx._state.get(key) or idx._add_key(key)  # as PackedKvIndexer.apply_batch does
        return batch_store(idx._core, idx._packed_masks, ks, idx.block_size, events)

    assert store_batch(idx, (0, 0), batch)
    assert idx.find_matches([1, 2, 3, 4]) == {(0, 0): 2}
    assert idx.find_matches([5, 6, 7, 8, 9, 9]) == {(0, 0): 3}
    assert idx.num_blocks() == 5 and idx.stats.stored_blocks == 5
    assert list(idx._state[(0, 0)].e2o) == [10, 11, 20, 21, 22]
    # A store chaining from an earlier store of the same batch too (its parent gains a child).
    assert store_batch(idx, (0, 0), [BlockStored([30], None, [], SIZE, own_hashes=[7]),
                                     BlockStored([31], 30, [], SIZE, own_hashes=[8])])
    assert idx.num_blocks() == 7 and idx._state[(0, 0)].e2o[30] >> 129 == 1
    # One chaining from a later store of the batch is left to the one-by-one path (which finds
    # its parent unknown).
    assert not store_batch(idx, (0, 0), [BlockStored([41], 40, [], SIZE, own_hashes=[9]),
                                         BlockStored([40], None, [], SIZE, own_hashes=[10])])
    assert idx.num_blocks() == 7
