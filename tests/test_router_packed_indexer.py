"""``PackedKvIndexer`` (issue 18, item 2: the index on packed integer tables) holds to the same
brute-force model as ``KvIndexer`` (every interleaving of stores, duplicates, conflicts,
removals, clears, orphans; capped with eviction too), and edge-hashed ingestion through the
wire into it builds the index ``KvIndexer`` builds from the tokens."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings

from router._packed_indexer import PackedKvIndexer
from router.events import BlockStored, decode_batch, decode_edge_batch, encode_batch
from router.hashing import block_hashes
from router.indexer import KvIndexer
from tests.support.indexer_models import CAP, SBS, CappedIndexerMachine, IndexerMachine, scenarios


class PackedIndexerMachine(IndexerMachine):
    def __init__(self) -> None:
        super().__init__()
        self.idx = PackedKvIndexer(SBS)


class PackedCappedIndexerMachine(CappedIndexerMachine):
    def __init__(self) -> None:
        super().__init__()
        self.idx = PackedKvIndexer(SBS, max_blocks=CAP, evict_oldest=True)


def _tiny_fronts(idx: PackedKvIndexer) -> PackedKvIndexer:
    """Fronts of 2 entries: token stores merge them into the tables mid-sequence, so stores
    sit in either part when they are removed, twinned or stored again."""
    idx._packed_masks.front_max = 2
    idx.e2o_front_max = 2
    return idx


class PackedTinyFrontsIndexerMachine(IndexerMachine):
    def __init__(self) -> None:
        super().__init__()
        self.idx = _tiny_fronts(PackedKvIndexer(SBS))


class PackedCappedTinyFrontsIndexerMachine(CappedIndexerMachine):
    def __init__(self) -> None:
        super().__init__()
        self.idx = _tiny_fronts(PackedKvIndexer(SBS, max_blocks=CAP, evict_oldest=True))


for _machine in (PackedIndexerMachine, PackedCappedIndexerMachine,
                 PackedTinyFrontsIndexerMachine, PackedCappedTinyFrontsIndexerMachine):
    _machine.TestCase.settings = IndexerMachine.TestCase.settings
test_packed_indexer_matches_brute_force_model = PackedIndexerMachine.TestCase
test_packed_capped_indexer_matches_model_without_evicted = PackedCappedIndexerMachine.TestCase
test_packed_tiny_fronts_match_brute_force_model = PackedTinyFrontsIndexerMachine.TestCase
test_packed_capped_tiny_fronts_match_model = PackedCappedTinyFrontsIndexerMachine.TestCase


def test_a_twin_in_the_masks_front_is_counted_before_a_removal_reads_it() -> None:
    """A token key stores one block under two engine hashes (``twin_store``), the second
    after the first was merged into the tables: the masks' front holds the key's bit again
    for the same own hash. Removing either engine hash must keep the block (one reference
    left), and removing both drops it, whether or not anything merged in between."""
    toks = list(range(SBS))
    own = block_hashes(toks, SBS)[0]
    for merge_between in (False, True):
        idx = PackedKvIndexer(SBS)
        idx.apply_stored((1, 0), [100], None, toks, SBS)
        idx._packed_masks.merge()
        idx.apply_stored((1, 0), [200], None, toks, SBS)  # its bit goes to the front again
        assert idx._packed_masks.front == {own: idx._state[(1, 0)].bit}
        if merge_between:
            idx._packed_masks.merge()
        idx.apply_removed((1, 0), [100])
        assert idx.find_matches(toks) == {(1, 0): 1}
        assert idx.num_blocks((1, 0)) == 1
        idx.apply_removed((1, 0), [200])
        assert idx.find_matches(toks) == {}
        assert idx.num_blocks() == 0 and idx._state[(1, 0)].shared == {}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_packed_edge_ingestion_builds_the_token_index(scenario) -> None:
    size, batches, queries = scenario
    by_tokens, by_edge = KvIndexer(size), PackedKvIndexer(size)
    for events in batches:
        payload = encode_batch(events, 0)
        by_tokens.apply_batch(7, decode_batch(payload))
        by_edge.apply_batch(7, decode_edge_batch(payload)[0])
    assert by_edge.num_blocks() == by_tokens.num_blocks()
    assert by_edge.num_unique_blocks() == by_tokens.num_unique_blocks()
    for lora in (None, "ad"):
        for q in queries:
            assert by_edge.find_matches(q, lora=lora) == by_tokens.find_matches(q, lora=lora)
    assert by_edge.stats == by_tokens.stats


def test_packed_index_past_64_keys_and_its_memory() -> None:
    """Keys past bit 63 move masks to the wide side dict and back; memory is counted."""
    idx = PackedKvIndexer(4)
    toks = list(range(8))
    owns = block_hashes(toks, 4)
    for w in range(70):
        idx.apply_batch(w, _one(BlockStored([10, 11], None, toks, 4, own_hashes=owns)))
    assert idx.find_matches(toks) == {(w, 0): 2 for w in range(70)}
    assert idx._packed_masks.wide
    for w in range(64, 70):
        idx.remove_worker(w)
    assert not idx._packed_masks.wide
    assert idx.find_matches(toks) == {(w, 0): 2 for w in range(64)}
    assert 0 < idx.bytes_per_block() < 2000


def _one(ev: BlockStored):  # type: ignore[no-untyped-def]
    from router.events import EventBatch
    return EventBatch(1.0, [ev])
