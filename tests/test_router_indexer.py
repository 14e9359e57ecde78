"""router.indexer and router.hashing: real vLLM captures, edge cases, and a stateful comparison
with a brute-force model over random interleavings of stores, duplicates, removals and clears
(the model and the machines: tests/support/indexer_models.py)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import xxhash

from router.events import BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch
from router.hashing import ROOT_SEED, block_hashes, root_hash, token_bytes
from router.indexer import KvIndexer
from tests.support.fixtures import VLLM_KV_EVENTS, vllm_kv_events
from tests.support.indexer_models import CappedIndexerMachine, IndexerMachine, Model

FIXTURES = VLLM_KV_EVENTS


# --- real vLLM captures --------------------------------------------------------------------------


def _captures() -> tuple[list[EventBatch], list[int], list[int]]:
    vllm_kv_events()  # fails clearly when the captures are missing
    batches = [decode_batch(p.read_bytes()) for p in sorted(FIXTURES.glob("batch_seq*.msgpack"))]
    req = json.loads((FIXTURES / "request1_tokens.json").read_text())
    return batches, req["prompt_token_ids"], req["output_token_ids"]


def test_vllm_captures_in_seq_order() -> None:
    batches, prompt, output = _captures()
    full = prompt + output
    idx, model = KvIndexer(32), Model(32)
    key = (9, 0)
    # The prompt's 3 full blocks are what seq0 stores.
    first = batches[0].events[0]
    assert isinstance(first, BlockStored) and first.token_ids == prompt[:96]
    expected_prompt = {0: 3, 6: 3, 7: 1, 9: 1, 10: 0, 18: 0}
    expected_full = {0: 3, 1: 4, 2: 4, 6: 4, 7: 1, 10: 0}
    for seq, batch in enumerate(batches):
        idx.apply_batch(9, batch)
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                model.store(key, ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size)
            elif isinstance(ev, BlockRemoved):
                model.remove(key, ev.block_hashes)
            else:
                model.clear(key)
        assert idx.find_matches(prompt) == model.find_matches(prompt), seq
        assert idx.find_matches(full) == model.find_matches(full), seq
        assert idx.num_blocks(key) == model.num_blocks(key), seq
        if seq in expected_prompt:
            assert idx.find_matches(prompt).get(key, 0) == expected_prompt[seq], seq
        if seq in expected_full:
            assert idx.find_matches(full).get(key, 0) == expected_full[seq], seq
        if seq == 2:  # the duplicate store of seq1 is counted, not a second block
            assert idx.num_blocks(key) == 4 and idx.stats.duplicate_stores == 1
    # The final AllBlocksCleared empties the worker; the key stays known.
    assert idx.num_blocks() == 0 and idx.num_blocks(key) == 0
    assert idx.num_unique_blocks() == 0
    assert idx.keys() == {key}
    s = idx.stats
    assert (s.unknown_parent, s.bad_length, s.unknown_removed, s.conflicts) == (0, 0, 0, 0)
    assert s.stored_blocks == 22 and s.removed_blocks == 12 and s.clears == 1


def test_captures_on_two_workers_and_remove_worker() -> None:
    batches, prompt, _ = _captures()
    idx = KvIndexer(32)
    idx.apply_batch(1, batches[0])
    idx.apply_batch(2, batches[0])
    assert idx.find_matches(prompt) == {(1, 0): 3, (2, 0): 3}
    idx.remove_worker(1)
    assert idx.find_matches(prompt) == {(2, 0): 3}
    assert idx.keys() == {(2, 0)}
    idx.apply_batch(3, batches[0])  # reuses worker 1's bit: nothing of worker 1 may leak
    assert idx.find_matches(prompt) == {(2, 0): 3, (3, 0): 3}


# --- edge cases ----------------------------------------------------------------------------------

BS = 4


def _toks(n_blocks: int, start: int = 1) -> list[int]:
    return list(range(start, start + n_blocks * BS))


def test_duplicate_store_needs_two_removals() -> None:
    idx = KvIndexer(BS)
    t = _toks(2)
    idx.apply_stored((1, 0), [10, 11], None, t, BS)
    idx.apply_stored((1, 0), [11], 10, t[BS:], BS)
    idx.apply_removed((1, 0), [11])
    assert idx.find_matches(t) == {(1, 0): 2}
    idx.apply_removed((1, 0), [11])
    assert idx.find_matches(t) == {(1, 0): 1}
    idx.apply_removed((1, 0), [11])
    assert idx.stats.unknown_removed == 1


def test_two_engine_hashes_for_one_prefix_are_both_references() -> None:
    idx = KvIndexer(BS)
    t = _toks(1)
    idx.apply_stored((1, 0), [10], None, t, BS)
    idx.apply_stored((1, 0), [20], None, t, BS)  # e.g. an engine-side salt we cannot see
    assert idx.num_blocks((1, 0)) == 2 and idx.num_unique_blocks() == 1
    idx.apply_removed((1, 0), [10])
    assert idx.find_matches(t) == {(1, 0): 1}
    idx.apply_removed((1, 0), [20])
    assert idx.find_matches(t) == {}


def test_conflicting_restore_keeps_first_content() -> None:
    idx = KvIndexer(BS)
    a, b = _toks(1), _toks(1, start=100)
    idx.apply_stored((1, 0), [10], None, a, BS)
    idx.apply_stored((1, 0), [10], None, b, BS)
    assert idx.stats.conflicts == 1
    assert idx.find_matches(a) == {(1, 0): 1} and idx.find_matches(b) == {}


def test_unknown_parent_is_ignored_until_rechained() -> None:
    idx = KvIndexer(BS)
    t = _toks(3)
    idx.apply_stored((1, 0), [11, 12], 10, t[BS:], BS)
    assert idx.stats.unknown_parent == 1 and idx.num_blocks() == 0
    idx.apply_stored((1, 0), [10], None, t[:BS], BS)
    idx.apply_stored((1, 0), [11, 12], 10, t[BS:], BS)
    assert idx.find_matches(t) == {(1, 0): 3}
    # The parent must be held by the same key.
    idx.apply_stored((2, 0), [12], 11, t[2 * BS:], BS)
    assert idx.stats.unknown_parent == 2 and (2, 0) not in idx.find_matches(t)


@pytest.mark.parametrize("n_tokens", [0, BS - 1, 2 * BS - 1, 2 * BS + 1, 3 * BS])
def test_token_count_mismatch_is_ignored(n_tokens: int) -> None:
    idx = KvIndexer(BS)
    idx.apply_stored((1, 0), [10, 11], None, list(range(n_tokens)), BS)
    assert idx.stats.bad_length == 1 and idx.num_blocks() == 0 and idx.keys() == {(1, 0)}


def test_other_block_size_is_ignored() -> None:
    idx = KvIndexer(BS)
    idx.apply_stored((1, 0), [10], None, list(range(2 * BS)), 2 * BS)
    assert idx.stats.block_size_mismatch == 1 and idx.num_blocks() == 0


@pytest.mark.parametrize("bad", [-1, 1 << 32, 1 << 63])
def test_out_of_range_token_ids_are_ignored(bad: int) -> None:
    idx = KvIndexer(BS)
    for n in (1, 2):
        tokens = [1] * (n * BS - 1) + [bad]
        idx.apply_stored((1, 0), list(range(10, 10 + n)), None, tokens, BS)
    assert idx.stats.bad_tokens == 2 and idx.num_blocks() == 0
    idx.apply_stored((1, 0), [20], None, [1] * BS, BS)
    with pytest.raises(ValueError):
        idx.find_matches([bad] * BS)


def test_empty_store_and_unknown_key_removal() -> None:
    idx = KvIndexer(BS)
    idx.apply_stored((1, 0), [], None, [], BS)
    idx.apply_removed((5, 5), [1, 2])
    idx.clear((6, 0))
    assert idx.num_blocks() == 0 and idx.stats.unknown_removed == 2
    assert idx.find_matches(_toks(2)) == {} and idx.find_matches([]) == {}


def test_lora_blocks_chain_from_their_own_root() -> None:
    idx = KvIndexer(BS)
    t = _toks(2)
    batch = EventBatch(0.0, [BlockStored([10, 11], None, t, BS, lora_id=3, lora_name="ad")], None)
    idx.apply_batch(1, batch)
    assert idx.find_matches(t) == {}
    assert idx.find_matches(t, lora="ad") == {(1, 0): 2}
    idx.apply_batch(1, EventBatch(0.0, [BlockStored([12], None, t[:BS], BS, lora_id=4)], 0))
    assert idx.find_matches(t, lora=4) == {(1, 0): 1}
    assert root_hash(None) == ROOT_SEED != root_hash("ad")


def test_extra_keys_salt_blocks_and_their_children() -> None:
    idx = KvIndexer(BS)
    t = _toks(3)
    ev = BlockStored([10, 11], None, t[:2 * BS], BS, extra_keys=[None, ["mm-hash", 0]])
    idx.apply_batch(1, EventBatch(0.0, [ev], 0))
    idx.apply_stored((1, 0), [12], 11, t[2 * BS:], BS)  # child of the salted block
    assert idx.num_blocks((1, 0)) == 3
    assert idx.find_matches(t) == {(1, 0): 1}  # only the unsalted first block is a token match
    idx.apply_stored((1, 0), [20, 21], None, t[:2 * BS], BS, extra_keys=[["x"]])  # wrong length
    assert idx.stats.bad_length == 1


def test_dp_rank_none_is_rank_zero_and_ranks_are_separate() -> None:
    idx = KvIndexer(BS)
    t = _toks(2)
    idx.apply_batch(1, EventBatch(0.0, [BlockStored([10, 11], None, t, BS)], None))
    idx.apply_batch(1, EventBatch(0.0, [BlockStored([10], None, t[:BS], BS)], 1))
    assert idx.find_matches(t) == {(1, 0): 2, (1, 1): 1}
    idx.apply_batch(1, decode_batch(encode_batch([BlockRemoved([10])], 1)))
    assert idx.find_matches(t) == {(1, 0): 2}
    idx.remove_worker(1)
    assert idx.keys() == set() and idx.num_blocks() == 0


def test_contiguous_prefix_only() -> None:
    idx = KvIndexer(BS)
    t = _toks(4)
    idx.apply_stored((1, 0), [10, 11, 12, 13], None, t, BS)
    idx.apply_removed((1, 0), [11])  # a hole: blocks 2 and 3 no longer count
    assert idx.find_matches(t) == {(1, 0): 1}
    assert idx.find_matches(t[: 3 * BS + 2]) == {(1, 0): 1}
    assert idx.find_matches(t[BS:]) == {}  # a non-root start never matches


def test_max_blocks_refuses_and_recovers() -> None:
    idx = KvIndexer(BS, max_blocks=3)
    t = _toks(5)
    idx.apply_stored((1, 0), [10, 11, 12, 13, 14], None, t, BS)
    assert idx.num_blocks() == 3 and idx.stats.refused == 2
    assert idx.find_matches(t) == {(1, 0): 3}
    idx.apply_stored((2, 0), [10], None, t[:BS], BS)
    assert idx.stats.refused == 3 and idx.find_matches(t) == {(1, 0): 3}
    idx.apply_stored((1, 0), [10], None, t[:BS], BS)  # a duplicate needs no room
    assert idx.stats.duplicate_stores == 1
    idx.apply_removed((1, 0), [12])
    idx.apply_stored((2, 0), [10], None, t[:BS], BS)
    assert idx.find_matches(t) == {(1, 0): 2, (2, 0): 1}
    with pytest.raises(ValueError):
        KvIndexer(BS, max_blocks=0)
    with pytest.raises(ValueError):
        KvIndexer(0)


def test_restore_with_other_content_poisons_until_clear() -> None:
    idx = KvIndexer(BS)
    t, u = _toks(3), _toks(1, start=500)
    idx.apply_stored((1, 0), [10, 11, 12], None, t, BS)
    idx.apply_removed((1, 0), [11])
    idx.apply_stored((1, 0), [11], 10, u, BS)  # engine hash 11 now names other content
    assert idx._state[(1, 0)].poisoned and idx._keys.dirty
    assert idx.find_matches(t) == {(1, 0): 1}
    assert idx.find_matches(t[:BS] + u) == {(1, 0): 2}
    idx.apply_removed((1, 0), [12, 11, 10])
    assert idx.num_blocks() == 0 and idx.find_matches(t) == {}
    idx.clear((1, 0))
    assert not idx._state[(1, 0)].poisoned and not idx._keys.dirty


def test_conflict_stops_the_rest_of_the_event() -> None:
    idx = KvIndexer(BS)
    t, u = _toks(2), _toks(2, start=500)
    idx.apply_stored((1, 0), [10], None, t[:BS], BS)
    idx.apply_stored((1, 0), [10, 11], None, u, BS)  # 10 conflicts: 11 chains from unheld content
    assert idx.stats.conflicts == 1 and idx.num_blocks() == 1
    assert idx.find_matches(u) == {} and idx.find_matches(t) == {(1, 0): 1}


def test_repeated_engine_hash_within_one_event() -> None:
    idx = KvIndexer(BS)
    t = _toks(3)
    idx.apply_stored((1, 0), [10, 11, 11], None, t, BS)
    assert idx.num_blocks() == 2 and idx.stats.duplicate_stores == 1 and idx.stats.conflicts == 1
    assert idx.find_matches(t) == {(1, 0): 2}


def test_holes_switch_to_the_exact_scan_and_back() -> None:
    idx = KvIndexer(BS)
    t = _toks(6)
    idx.apply_stored((1, 0), [10, 11, 12, 13, 14, 15], None, t, BS)
    idx.apply_stored((2, 0), [10, 11, 12], None, t[: 3 * BS], BS)
    assert idx.find_matches(t) == {(1, 0): 6, (2, 0): 3} and not idx._keys.dirty
    idx.apply_removed((1, 0), [12])  # block 3 of key 1 is an orphan now (4, 5 hang on it)
    assert idx._state[(1, 0)].orphans == 1 and idx._keys.dirty == idx._state[(1, 0)].bit
    assert idx._state[(1, 0)].orphan_parents == {12: (1, block_hashes(t[: 3 * BS], BS)[2])}
    assert idx.find_matches(t) == {(1, 0): 2, (2, 0): 3}
    idx.apply_stored((1, 0), [12], 11, t[2 * BS : 3 * BS], BS)  # the parent comes back
    assert idx._state[(1, 0)].orphans == 0 and not idx._keys.dirty
    assert idx.find_matches(t) == {(1, 0): 6, (2, 0): 3}
    idx.apply_removed((1, 0), [11])
    idx.apply_removed((1, 0), [12, 13, 14, 15])  # removing the orphans cleans the key
    assert idx._state[(1, 0)].orphans == 0 and not idx._keys.dirty
    assert idx.find_matches(t) == {(1, 0): 1, (2, 0): 3}
    idx.apply_removed((2, 0), [10])
    assert idx.find_matches(t) == {(1, 0): 1}
    idx.clear((2, 0))
    assert idx._state[(2, 0)].orphans == 0 and not idx._keys.dirty


def test_many_keys_beyond_64_bits() -> None:
    idx = KvIndexer(BS)
    t = _toks(8)
    for w in range(70):
        n = 1 + w % 8
        idx.apply_stored((w, w % 3), list(range(100, 100 + n)), None, t[: n * BS], BS)
    assert idx.find_matches(t) == {(w, w % 3): 1 + w % 8 for w in range(70)}
    for w in range(0, 70, 2):
        idx.remove_worker(w)
    assert idx.find_matches(t) == {(w, w % 3): 1 + w % 8 for w in range(1, 70, 2)}


def test_find_matches_for_hashes_and_long_prompts() -> None:
    idx = KvIndexer(BS)
    rng = np.random.default_rng(1)
    t = rng.integers(0, 50_000, size=600 * BS).tolist()
    hashes = block_hashes(t, BS)
    for w, n in enumerate([600, 599, 300, 33, 32, 31, 1]):
        idx.apply_stored((w, 0), [h ^ w for h in hashes[:n]], None, t[: n * BS], BS)
    want = {(w, 0): n for w, n in enumerate([600, 599, 300, 33, 32, 31, 1])}
    assert idx.find_matches(t) == idx.find_matches_for_hashes(hashes) == want
    assert idx.find_matches(np.asarray(t, dtype=np.int64)) == want
    assert idx.find_matches_for_hashes([]) == {}
    assert 50 < idx.bytes_per_block() < 2000


def test_bytes_per_block_is_zero_when_empty() -> None:
    assert KvIndexer(BS).bytes_per_block() == 0.0


# --- hashing -------------------------------------------------------------------------------------


def test_block_hashes_formula_and_forms() -> None:
    t = list(range(1000, 1000 + 3 * BS + 2))
    hs = block_hashes(t, BS)
    assert len(hs) == 3  # the trailing partial block is ignored
    expect = xxhash.xxh3_64_intdigest(np.asarray(t[:BS], dtype="<u4").tobytes(), ROOT_SEED)
    assert hs[0] == expect
    assert hs[1] == xxhash.xxh3_64_intdigest(np.asarray(t[BS:2 * BS], dtype="<u4").tobytes(), hs[0])
    assert block_hashes(tuple(t), BS) == hs
    assert block_hashes(np.asarray(t, dtype=np.int64), BS) == hs
    assert block_hashes(np.asarray(t, dtype=np.uint32), BS) == hs
    assert block_hashes(token_bytes(t), BS) == hs
    assert block_hashes(t[BS:], BS, parent=hs[0]) == hs[1:]  # chaining composes
    assert block_hashes(t[: BS - 1], BS) == []


@pytest.mark.parametrize("bad", [[-1], [1 << 32], ["a"], [1.5]])
def test_block_hashes_rejects_bad_tokens(bad: list[Any]) -> None:
    with pytest.raises(ValueError):
        block_hashes(bad * BS, BS)


def test_block_hashes_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError):
        block_hashes([1] * BS, 0)
    with pytest.raises(ValueError):
        block_hashes(b"\x00" * 5, 1)
    with pytest.raises(ValueError):
        block_hashes(np.zeros(BS, dtype=np.float32), BS)
    with pytest.raises(ValueError):
        block_hashes(np.full(BS, -1, dtype=np.int64), BS)


# --- stateful comparison with the model ----------------------------------------------------------

test_indexer_matches_brute_force_model = IndexerMachine.TestCase
test_capped_indexer_matches_model_without_evicted = CappedIndexerMachine.TestCase


def test_cap_evicts_oldest_leaves_first_and_keeps_routing() -> None:
    idx = KvIndexer(BS, max_blocks=6, evict_oldest=True)
    old, new = _toks(4), [t + 1000 for t in _toks(4)]
    idx.apply_stored((1, 0), [1, 2, 3, 4], None, old, BS)
    idx.apply_stored((2, 0), [5, 6], None, new[:2 * BS], BS)
    idx.apply_stored((2, 0), [7, 8], 6, new[2 * BS:], BS)  # full: (1, 0) is the largest key
    assert idx.num_blocks() == 6 and idx.stats.evicted == 2 and idx.stats.refused == 0
    assert idx.find_matches(old) == {(1, 0): 2}  # its chain lost its tail, kept its prefix
    assert idx.find_matches(new) == {(2, 0): 4}
    assert idx._keys.dirty == 0  # no orphans: the binary-searched lookup stays valid
    idx.apply_removed((1, 0), [3, 4])  # the engine's own removal of evicted blocks: unknown
    assert idx.stats.unknown_removed == 2 and idx.stats.removed_blocks == 0
    with pytest.raises(ValueError):
        KvIndexer(BS, max_blocks=0, evict_oldest=True)
