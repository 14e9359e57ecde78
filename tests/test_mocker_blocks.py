"""The mocker's block manager against a brute-force model (hypothesis), plus its edge cases.

The model keeps, per held sequence, the block ids it owns, and a plain dict of every hash the
manager announced (BlockStored adds, BlockRemoved deletes). After every operation: the free,
active and cached counts add up to the total; each block's reference count equals the number of
held sequences that own it; a prefix match returns exactly what a dict lookup of the announced
hashes gives; and removals only name hashes that are announced and unreferenced.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engines.mocker._blocks import BlockManager
from engines.mocker._hashing import block_hash, chain_hashes
from engines.mocker._kv_events import AllBlocksCleared, BlockRemoved, BlockStored

BS = 2

prompts = st.lists(st.integers(0, 2), max_size=10)
# One operation: (roll, prompt, extra tokens, index). The roll picks the kind: mostly
# allocations and frees, sometimes a lookup, rarely a cache reset.
ops = st.lists(st.tuples(st.integers(0, 99), prompts, st.integers(0, 3), st.integers(0, 50)),
               min_size=4, max_size=60)


def kind(roll: int) -> str:
    return "alloc" if roll < 50 else "free" if roll < 85 else "lookup" if roll < 97 else "reset"


class Model:
    """What a correct manager must look like from outside."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.held: list[list[int]] = []
        self.announced: dict[int, int] = {}  # hash -> block id, from the events

    def consume_events(self) -> None:
        for ev in self.bm.take_events():
            if isinstance(ev, BlockStored):
                assert len(ev.token_ids) == BS * len(ev.block_hashes) and ev.block_size == BS
                for i, h in enumerate(ev.block_hashes):
                    assert h not in self.announced, "a hash stored twice without a removal"
                    parent = ev.parent_block_hash if i == 0 else ev.block_hashes[i - 1]
                    assert block_hash(parent, ev.token_ids[i * BS : (i + 1) * BS]) == h
                    self.announced[h] = -1  # block id filled in by the caller
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    block = self.announced.pop(h)  # KeyError: removal of an unknown hash
                    assert self.bm.block_hash(block) != h
                    assert all(block not in held for held in self.held), "evicted a block in use"
            else:
                assert isinstance(ev, AllBlocksCleared)
                self.announced.clear()

    def expected_match(self, hashes: list[int]) -> list[int]:
        found = []
        for h in hashes:
            if h not in self.announced:
                break
            found.append(self.announced[h])
        return found

    def check(self) -> None:
        bm = self.bm
        assert bm.num_free + bm.num_active + bm.num_cached == bm.num_blocks
        counts = [0] * bm.num_blocks
        for held in self.held:
            for b in held:
                counts[b] += 1
        assert [bm.ref_count(b) for b in range(bm.num_blocks)] == counts
        assert bm.num_active == sum(1 for c in counts if c)
        assert bm.cached_hashes() == self.announced
        for h, b in self.announced.items():
            assert bm.block_hash(b) == h


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 8), operations=ops)
def test_block_manager_matches_a_brute_force_model(
    num_blocks: int, operations: list[tuple[int, list[int], int, int]]
) -> None:
    bm = BlockManager(num_blocks, BS)
    model = Model(bm)
    for roll, prompt, extra, index in operations:
        op = kind(roll)
        if op == "alloc":
            tokens = [*prompt, *([1] * extra)]
            hashes = chain_hashes(tokens, BS)
            hits = bm.match_prefix(hashes)
            assert hits == model.expected_match(hashes)
            need = -(-len(tokens) // BS) - len(hits)
            available = bm.num_free + bm.num_cached - sum(1 for b in hits if bm.ref_count(b) == 0)
            blocks = bm.allocate(need, hits)
            model.consume_events()
            if blocks is None:
                assert need > available
                model.check()
                continue
            assert blocks[: len(hits)] == hits and len(set(blocks)) == len(blocks)
            model.held.append(blocks)
            start = len(hits)
            full = len(hashes)
            bm.cache_blocks(blocks[start:full], hashes[start:full],
                            hashes[start - 1] if start else None, tokens[start * BS : full * BS])
            before = dict(model.announced)
            model.consume_events()
            for i in range(start, full):
                if hashes[i] not in before and bm.block_hash(blocks[i]) == hashes[i]:
                    model.announced[hashes[i]] = blocks[i]
        elif op == "free":
            if model.held:
                bm.free(model.held.pop(index % len(model.held)))
        elif op == "lookup":
            hashes = chain_hashes(prompt, BS)
            assert bm.match_prefix(hashes) == model.expected_match(hashes)
        else:
            assert bm.reset_prefix_cache() == (not any(model.held))
            model.consume_events()
        model.consume_events()
        model.check()
    for held in model.held:
        bm.free(held)
    model.held.clear()
    model.consume_events()
    model.check()
    assert bm.num_free + bm.num_cached == num_blocks


def test_eviction_is_lru_and_announced() -> None:
    bm = BlockManager(3, BS)
    a = bm.allocate(1)
    b = bm.allocate(1)
    assert a is not None and b is not None
    ha, hb = block_hash(None, [1, 1]), block_hash(None, [2, 2])
    bm.cache_blocks(a, [ha], None, [1, 1])
    bm.cache_blocks(b, [hb], None, [2, 2])
    bm.free(a)
    bm.free(b)
    assert bm.num_cached == 2 and bm.take_events() == [
        BlockStored([ha], None, [1, 1], BS), BlockStored([hb], None, [2, 2], BS)]
    assert bm.allocate(2) is not None  # one free block, then the least recently freed (a)
    assert bm.take_events() == [BlockRemoved([ha])]
    assert bm.match_prefix([hb]) == b and bm.match_prefix([ha]) == []


def test_reviving_a_cached_block_takes_it_out_of_the_pool() -> None:
    bm = BlockManager(2, BS)
    first = bm.allocate(1)
    assert first is not None
    h = block_hash(None, [5, 5])
    bm.cache_blocks(first, [h], None, [5, 5])
    bm.free(first)
    hits = bm.match_prefix([h])
    assert bm.allocate(2, hits) is None  # the hit itself is not spare capacity
    again = bm.allocate(1, hits)
    assert again is not None and again[0] == first[0] and again[1] != first[0]
    assert bm.num_cached == 0 and bm.num_active == 2 and bm.ref_count(first[0]) == 1


def test_duplicate_content_stays_private() -> None:
    bm = BlockManager(4, BS)
    x, y = bm.allocate(1), bm.allocate(1)
    assert x is not None and y is not None
    h = block_hash(None, [3, 4])
    assert bm.cache_blocks(x, [h], None, [3, 4]) == 1
    assert bm.cache_blocks(y, [h], None, [3, 4]) == 0
    bm.free(y)
    assert bm.num_free == 3 and bm.match_prefix([h]) == x


def test_disabled_caching_caches_nothing() -> None:
    bm = BlockManager(2, BS, enable_caching=False)
    blocks = bm.allocate(2)
    assert blocks is not None
    assert bm.cache_blocks(blocks, chain_hashes([1, 2, 3, 4], BS), None, [1, 2, 3, 4]) == 0
    bm.free(blocks)
    assert bm.num_free == 2 and bm.take_events() == []


def test_chain_hashes_chain() -> None:
    hashes = chain_hashes([1, 2, 3, 4, 5], BS)
    assert hashes == [block_hash(None, [1, 2]), block_hash(block_hash(None, [1, 2]), [3, 4])]
    assert all(0 <= h < 2**64 for h in hashes)
