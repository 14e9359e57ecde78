"""For the KV index tests (``KvIndexer`` and ``PackedKvIndexer``): a brute-force ``Model`` of
the index, Hypothesis state machines that compare an index with it over random interleavings of
stores, duplicates, removals and clears (a test module runs one as ``test_x = Machine.TestCase``,
or subclasses it to put another index in ``idx``), and ``scenarios``: the event batches an
edge-hashing publisher sends, with prompts to query."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import xxhash
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from router.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    decode_batch,
    encode_batch,
)
from router.hashing import block_hashes, root_hash
from router.indexer import KvIndexer, WorkerKey

MASK = (1 << 64) - 1


# --- a brute-force model of the index -------------------------------------------------------------


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


# --- stateful comparisons of an index with the model ----------------------------------------------

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


# --- edge-hashed event batches --------------------------------------------------------------------


def _engine_hashes(tokens: list[int], size: int, salt: int) -> list[int]:
    """An engine's own chained hashes (unlike the router's: another function, another seed)."""
    out, h = [], salt
    for i in range(len(tokens) // size):
        h = xxhash.xxh64_intdigest(repr((h, tokens[i * size:(i + 1) * size])).encode())
        out.append(h)
    return out


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[int, list[list[KvEvent]], list[list[int]]]:
    """A block size, batches of events an edge-hashing publisher sends, and prompts to query."""
    size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    vocab = draw(st.integers(2, 6))  # small vocabularies: prompts share prefixes
    prompts = draw(st.lists(st.lists(st.integers(0, vocab), min_size=size, max_size=8 * size),
                            min_size=1, max_size=6))
    loras = [draw(st.sampled_from([None, None, "ad"])) for _ in prompts]
    chains = []
    for p, lora in zip(prompts, loras, strict=True):
        root = None if lora is None else root_hash(lora)
        salt = 0 if lora is None else 1
        chains.append((_engine_hashes(p, size, salt), block_hashes(p, size, root)))
    batches: list[list[KvEvent]] = []
    stored: list[int] = []
    for _ in range(draw(st.integers(1, 14))):
        events: list[KvEvent] = []
        for _ in range(draw(st.integers(1, 3))):
            kind = draw(st.sampled_from(["store", "store", "store", "remove", "clear"]))
            if kind == "store":
                i = draw(st.integers(0, len(prompts) - 1))
                eng, own = chains[i]
                if not eng:
                    continue
                a = draw(st.integers(0, len(eng) - 1))
                b = draw(st.integers(a + 1, len(eng)))
                toks = prompts[i][a * size:b * size]
                events.append(BlockStored(eng[a:b], eng[a - 1] if a else None, toks, size,
                                          lora_name=loras[i], own_hashes=own[a:b]))
                stored += eng[a:b]
            elif kind == "remove" and stored:
                events.append(BlockRemoved(draw(st.lists(st.sampled_from(stored), max_size=4))))
            elif kind == "clear":
                events.append(AllBlocksCleared())
        batches.append(events)
    queries = [p[:k] for p in prompts for k in range(size, len(p) + 1, size)]
    queries += draw(st.lists(st.lists(st.integers(0, vocab), max_size=6 * size), max_size=4))
    return size, batches, queries
