"""router.indexer and router.hashing: real vLLM captures, edge cases, and a stateful comparison
with a brute-force model over random interleavings of stores, duplicates, removals and clears."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from router.events import BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch
from router.hashing import ROOT_SEED, block_hashes, root_hash, token_bytes
from router.indexer import KvIndexer, WorkerKey
from tests.support.fixtures import VLLM_KV_EVENTS, vllm_kv_events

FIXTURES = VLLM_KV_EVENTS
MASK = (1 << 64) - 1


# --- brute-force model ---------------------------------------------------------------------------


class Model:
    """Per key, a multiset engine hash -> [count, token prefix, parent engine hash]. Answers by
    walking the prompt's blocks."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.keys: dict[WorkerKey, dict[int, list[Any]]] = {}

    def store(self, key: WorkerKey, hashes: Sequence[int], parent: int | None,
              tokens: Sequence[int], block_size: int) -> None:
        held = self.keys.setdefault(key, {})
        if block_size != self.bs or len(tokens) != len(hashes) * block_size:
            return
        if parent is None:
            prefix: tuple[int, ...] = ()
        elif parent in held:
            prefix = held[parent][1]
        else:
            return
        for i, h in enumerate(hashes):
            prefix = prefix + tuple(tokens[i * block_size:(i + 1) * block_size])
            if h in held:
                held[h][0] += 1  # duplicate: count it, keep the first content
            else:
                held[h] = [1, prefix, parent]
            parent = h

    def remove(self, key: WorkerKey, hashes: Sequence[int]) -> None:
        held = self.keys.get(key, {})
        for h in hashes:
            if h in held:
                held[h][0] -= 1
                if not held[h][0]:
                    del held[h]

    def clear(self, key: WorkerKey) -> None:
        if key in self.keys:
            self.keys[key] = {}

    def remove_worker(self, worker_id: int) -> None:
        for key in [k for k in self.keys if k[0] == worker_id]:
            del self.keys[key]

    def find_matches(self, tokens: Sequence[int]) -> dict[WorkerKey, int]:
        out = {}
        for key, held in self.keys.items():
            prefixes = {entry[1] for entry in held.values()}
            n = 0
            while (
                (n + 1) * self.bs <= len(tokens) and tuple(tokens[:(n + 1) * self.bs]) in prefixes
            ):
                n += 1
            if n:
                out[key] = n
        return out

    def num_blocks(self, key: WorkerKey) -> int:
        return len(self.keys.get(key, {}))


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

SBS = 2  # small blocks and a 2-token alphabet: prefixes collide constantly
WORKERS = (1, 2, 3)
RANKS = (0, 1)
_seq = st.lists(st.integers(0, 1), min_size=SBS, max_size=5 * SBS)


def _engine_hash(prefix: Sequence[int], salt: int) -> int:
    """What an engine would publish: a function of the whole prefix (plus an invisible salt)."""
    return xxhash.xxh64_intdigest(repr((salt, tuple(prefix))).encode())


class IndexerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.idx = KvIndexer(SBS)
        self.model = Model(SBS)
        self.seen: list[list[int]] = [[0, 0, 0, 0], [1, 1, 1, 1, 1, 1]]
        self.removed: list[tuple[WorkerKey, int, list[Any]]] = []

    def _apply(self, key: WorkerKey, hashes: list[int], parent: int | None, tokens: list[int],
               block_size: int, via_batch: bool) -> None:
        if via_batch:
            ev = BlockStored(hashes, parent, tokens, block_size)
            self.idx.apply_batch(key[0], decode_batch(encode_batch([ev], key[1])))
        else:
            self.idx.apply_stored(key, hashes, parent, tokens, block_size)
        self.model.store(key, hashes, parent, tokens, block_size)

    @rule(w=st.sampled_from(WORKERS), r=st.sampled_from(RANKS), seq=_seq,
          data=st.data(), salt=st.integers(0, 1), via_batch=st.booleans())
    def store(self, w: int, r: int, seq: list[int], data: st.DataObject, salt: int,
              via_batch: bool) -> None:
        n_blocks = len(seq) // SBS
        start = data.draw(st.integers(0, n_blocks - 1))
        count = data.draw(st.integers(1, n_blocks - start))
        hashes = [_engine_hash(seq[:(i + 1) * SBS], salt) for i in range(start, start + count)]
        parent = _engine_hash(seq[:start * SBS], salt) if start else None
        tokens = seq[start * SBS:(start + count) * SBS]
        self.seen.append(seq)
        self._apply((w, r), hashes, parent, tokens, SBS, via_batch)

    @rule(w=st.sampled_from(WORKERS), r=st.sampled_from(RANKS), seq=_seq,
          kind=st.sampled_from(["short", "long", "block_size"]))
    def bad_store(self, w: int, r: int, seq: list[int], kind: str) -> None:
        n = len(seq) // SBS
        hashes = [_engine_hash(seq[:(i + 1) * SBS], 0) for i in range(n)]
        tokens = seq[: n * SBS]
        if kind == "short":
            tokens = tokens[:-1]
        elif kind == "long":
            tokens = [*tokens, 0]
        bs = SBS * 2 if kind == "block_size" else SBS
        self._apply((w, r), hashes, None, tokens, bs, via_batch=False)

    def _held_block(self, data: st.DataObject) -> tuple[WorkerKey, int, list[Any]]:
        key = data.draw(st.sampled_from(sorted(k for k, v in self.model.keys.items() if v)))
        h = data.draw(st.sampled_from(sorted(self.model.keys[key])))
        return key, h, self.model.keys[key][h]

    @precondition(lambda self: any(self.model.keys.values()))
    @rule(data=st.data(), via_batch=st.booleans())
    def duplicate_store(self, data: st.DataObject, via_batch: bool) -> None:
        """The engine publishes a block it already published (vLLM does)."""
        key, h, (_, prefix, parent) = self._held_block(data)
        self._apply(key, [h], parent, list(prefix[-SBS:]), SBS, via_batch)

    @precondition(lambda self: any(self.model.keys.values()))
    @rule(data=st.data(), salt=st.integers(2, 3))
    def twin_store(self, data: st.DataObject, salt: int) -> None:
        """Same prefix, same parent, another engine hash (an engine-side salt the router cannot
        see): two references to one own hash."""
        key, _, (_, prefix, parent) = self._held_block(data)
        self._apply(key, [_engine_hash(prefix, salt)], parent, list(prefix[-SBS:]), SBS, False)

    @precondition(lambda self: any(self.model.keys.values()))
    @rule(data=st.data(), salt=st.integers(2, 3), twin_goes=st.booleans())
    def twin_store_then_remove(self, data: st.DataObject, salt: int, twin_goes: bool) -> None:
        """A twin store and the removal of one of the two engine hashes in one step, with no
        read between: a layout that counts the twin late must count it before the removal."""
        key, h, (_, prefix, parent) = self._held_block(data)
        twin = _engine_hash(prefix, salt)
        self._apply(key, [twin], parent, list(prefix[-SBS:]), SBS, False)
        gone = twin if twin_goes else h
        if gone in self.model.keys[key]:
            self.removed.append((key, gone, list(self.model.keys[key][gone])))
        self.idx.apply_removed(key, [gone])
        self.model.remove(key, [gone])

    @precondition(lambda self: any(self.model.keys.values()))
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(k for k, v in self.model.keys.items() if v)))
        held = sorted(self.model.keys[key])
        hashes = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=4))
        self.removed += [(key, h, list(self.model.keys[key][h])) for h in hashes]
        self.idx.apply_removed(key, hashes)
        self.model.remove(key, hashes)

    @precondition(lambda self: self.removed)
    @rule(data=st.data())
    def restore_removed(self, data: st.DataObject) -> None:
        """Store again a block removed earlier (a parent re-stored under its held children)."""
        key, h, (_, prefix, parent) = data.draw(st.sampled_from(self.removed))
        self._apply(key, [h], parent, list(prefix[-SBS:]), SBS, False)

    @rule(w=st.sampled_from(WORKERS), r=st.sampled_from(RANKS), h=st.integers(0, MASK))
    def remove_unknown(self, w: int, r: int, h: int) -> None:
        self.idx.apply_removed((w, r), [h])
        self.model.remove((w, r), [h])

    @rule(w=st.sampled_from(WORKERS), r=st.sampled_from(RANKS))
    def clear(self, w: int, r: int) -> None:
        self.idx.clear((w, r))
        self.model.clear((w, r))

    @rule(w=st.sampled_from(WORKERS))
    def remove_worker(self, w: int) -> None:
        before = {k for k in self.idx.keys() if k[0] != w}
        self.idx.remove_worker(w)
        self.model.remove_worker(w)
        assert self.idx.keys() == before

    @invariant()
    def matches_agree(self) -> None:
        for seq in self.seen[-12:]:
            for probe in (seq, seq[: len(seq) // 2], [*seq, 0, 1]):
                assert self.idx.find_matches(probe) == self.model.find_matches(probe), probe

    @invariant()
    def orphan_bookkeeping_is_exact(self) -> None:
        idx = self.idx
        dirty = 0
        for ks in idx._state.values():
            held = {
                eh: (p & MASK, (p >> 64) & MASK if p >> 128 & 1 else None)
                for eh, p in ks.e2o.items()
            }
            assert all(idx._masks.get(o, 0) & ks.bit for o, _ in held.values())
            children: dict[int, int] = {}
            for _, pe in held.values():
                if pe is not None:
                    children[pe] = children.get(pe, 0) + 1
            assert not ks.poisoned
            for eh, p in ks.e2o.items():
                assert p >> 129 == children.get(eh, 0)
            missing = {pe: c for pe, c in children.items() if pe not in held}
            assert {pe: c for pe, (c, _) in ks.orphan_parents.items()} == missing
            assert ks.orphans == sum(missing.values())
            dirty |= ks.bit if ks.orphans else 0
        assert idx._keys.dirty == dirty

    @invariant()
    def counts_agree(self) -> None:
        total = 0
        for key in self.model.keys:
            assert self.idx.num_blocks(key) == self.model.num_blocks(key)
            total += self.model.num_blocks(key)
        assert self.idx.num_blocks() == total
        assert set(self.model.keys) <= self.idx.keys()


IndexerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_indexer_matches_brute_force_model = IndexerMachine.TestCase


CAP = 6  # stores are at most 5 blocks: eviction can always make room, nothing is refused


class CappedIndexerMachine(IndexerMachine):
    """The same interleavings on an index capped at ``CAP`` blocks that evicts the oldest.

    After each step the model drops the blocks the index evicted (each one counted in
    ``stats.evicted``, and only when the index was full): every invariant above then compares
    the index with the model restricted to the blocks not evicted, so an evicted block is never
    credited and no other block is lost."""

    def __init__(self) -> None:
        super().__init__()
        self.idx = KvIndexer(SBS, max_blocks=CAP, evict_oldest=True)
        self.evicted = 0

    def _apply(self, key: WorkerKey, hashes: list[int], parent: int | None, tokens: list[int],
               block_size: int, via_batch: bool) -> None:
        before = self.idx.num_blocks()
        super()._apply(key, hashes, parent, tokens, block_size, via_batch)
        gone = [(k, h) for k, held in self.model.keys.items() for h in held
                if h not in self.idx._state[k].e2o]
        for k, h in gone:
            del self.model.keys[k][h]
        assert self.idx.stats.evicted - self.evicted == len(gone)
        assert not gone or before + len(hashes) > CAP  # evicts only when full
        self.evicted = self.idx.stats.evicted

    @invariant()
    def within_cap(self) -> None:
        assert self.idx.num_blocks() <= CAP and self.idx.stats.refused == 0


CappedIndexerMachine.TestCase.settings = IndexerMachine.TestCase.settings
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
