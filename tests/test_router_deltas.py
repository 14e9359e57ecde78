"""Own-hash deltas into the KV index (issue 18, items 1 and 2): ``decode_own_batch`` and the
delta keys of ``KvIndexer`` / ``PackedKvIndexer``.

A stateful comparison with a brute-force model (per key, the set of own hashes held; a prompt
matches the longest leading run of its hashes a key holds) drives random interleavings through
the wire (``encode_own_batch`` -> bytes -> ``decode_own_batch`` -> ``apply_batch``): stores,
removals that leave holes, clears, publisher bugs, dumps after a worker's state is dropped, and
token-path keys beside the delta keys in one index; on both layouts, and capped. Malformed
payloads raise ``EventDecodeError`` only; through a real subscriber on real ZMQ sockets they
are counted and skipped, and a full dump in delta form replaces a worker's stale state."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from dynamo_zmq.llm import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    OwnEvent,
    OwnRemoved,
    OwnStored,
    encode_batch,
    encode_own_batch,
)
from dynamo_zmq.llm._block_hashing import FORM_DELTAS
from dynamo_zmq.resources import Resources
from engines.mocker._publisher import KvEventPublisher
from router._own_events import decode_own_batch, pick_decoder
from router._packed_indexer import PackedKvIndexer
from router.events import EventDecodeError, decode_batch
from router.hashing import block_hashes
from router.indexer import KvIndexer, WorkerKey
from router.metrics import RouterMetrics
from router.subscriber import KvEventSubscriber

BS = 2
SALT = 0x5A5A5A5A5A5A5A5A
# The universe: every sequence of 1-4 blocks over two distinct blocks (30 prefixes, a tree).
PROMPTS = [[t for b in p for t in b] for p in itertools.product([[0, 0], [1, 1]], repeat=4)]
PARENT: dict[int, int | None] = {}
DEPTH: dict[int, int] = {}
for _p in PROMPTS:
    _hs = block_hashes(_p, BS)
    for _i, _h in enumerate(_hs):
        PARENT[_h], DEPTH[_h] = (_hs[_i - 1] if _i else None), _i
NODES = sorted(PARENT)
DELTA_KEYS: list[WorkerKey] = [(1, 0), (1, 1), (2, 0)]
TOKEN_KEYS: list[WorkerKey] = [(3, 0), (3, 1)]


def holes(held: set[int] | dict[int, None]) -> int:
    return sum(1 for h in held if PARENT[h] is not None and PARENT[h] not in held)


def brute_matches(sets: dict[WorkerKey, Any], tokens: list[int]) -> dict[WorkerKey, int]:
    hs = block_hashes(tokens, BS)
    out = {}
    for key, held in sets.items():
        n = 0
        while n < len(hs) and hs[n] in held:
            n += 1
        if n:
            out[key] = n
    return out


def send(idx: KvIndexer, key: WorkerKey, events: list[OwnEvent]) -> None:
    batch, _ = decode_own_batch(encode_own_batch(events, key[1]))
    idx.apply_batch(key[0], batch)


_subset = st.lists(st.sampled_from(NODES), max_size=8)


class DeltaMachine(RuleBasedStateMachine):
    """Delta keys (workers 1, 2) and token-path keys (worker 3) in one index, against the model.
    ``held`` keeps each key's own hashes in the publisher's insertion order (dumps send it)."""

    def __init__(self) -> None:
        super().__init__()
        self.idx = self.make_index()
        self.held: dict[WorkerKey, dict[int, None]] = {k: {} for k in DELTA_KEYS + TOKEN_KEYS}

    def make_index(self) -> KvIndexer:
        return KvIndexer(BS)

    @rule(key=st.sampled_from(DELTA_KEYS),
          ops=st.lists(st.tuples(st.sampled_from(["store", "remove", "clear"]), _subset),
                       min_size=1, max_size=3))
    def deltas(self, key: WorkerKey, ops: list[tuple[str, list[int]]]) -> None:
        """One batch of 1-3 events as a correct publisher sends them."""
        held, events = self.held[key], []
        for op, nodes in ops:
            if op == "clear":
                held.clear()
                events.append(AllBlocksCleared())
                continue
            if op == "store":
                new = sorted({h for h in nodes if h not in held}, key=DEPTH.__getitem__)
                held.update(dict.fromkeys(new))
                events.append(OwnStored(new, holes(held)))
            else:
                gone = [h for h in dict.fromkeys(nodes) if h in held]
                for h in gone:
                    del held[h]
                events.append(OwnRemoved(gone, holes(held)))
        send(self.idx, key, events)

    @rule(key=st.sampled_from(DELTA_KEYS), nodes=_subset, stored=st.booleans())
    def publisher_bug(self, key: WorkerKey, nodes: list[int], stored: bool) -> None:
        """A store of hashes already held or a removal of hashes not held: ignored, counted."""
        held, idx = self.held[key], self.idx
        exact = idx.max_blocks > 100  # (capped: the index may lack what is held)
        if stored:
            bad = [h for h in nodes if h in held]
            before = idx.stats.duplicate_stores
            send(idx, key, [OwnStored(bad, holes(held))])
            assert idx.stats.duplicate_stores - before == len(bad) or not exact
        else:
            bad = [h for h in dict.fromkeys(nodes) if h not in held]
            before = idx.stats.unknown_removed
            send(idx, key, [OwnRemoved(bad, holes(held))])
            assert idx.stats.unknown_removed - before == len(bad) or not exact

    @rule(key=st.sampled_from(DELTA_KEYS), nodes=_subset)
    def duplicate_then_removed(self, key: WorkerKey, nodes: list[int]) -> None:
        """A store of held hashes and their removal in one batch: the duplicates are counted
        even though the removal comes before anything reads the index."""
        held, idx = self.held[key], self.idx
        bad = [h for h in dict.fromkeys(nodes) if h in held]
        before, holes_before = idx.stats.duplicate_stores, holes(held)
        for h in bad:
            del held[h]
        send(idx, key, [OwnStored(bad, holes_before), OwnRemoved(bad, holes(held))])
        if idx.max_blocks > 100:
            assert idx.stats.duplicate_stores - before == len(bad)

    @rule(w=st.sampled_from([1, 2]))
    def restart(self, w: int) -> None:
        """A router's warm restart: the worker's state dropped, then its dump applied."""
        self.idx.remove_worker(w)
        for key in DELTA_KEYS:
            if key[0] == w:
                held = self.held[key]
                send(self.idx, key, [OwnStored(list(held), holes(held))])

    @rule(key=st.sampled_from(TOKEN_KEYS), p=st.sampled_from(PROMPTS), k=st.integers(1, 4),
          via_batch=st.booleans())
    def token_store(self, key: WorkerKey, p: list[int], k: int, via_batch: bool) -> None:
        hs, held = block_hashes(p, BS), self.held[key]
        j = 0
        while j < len(hs) and hs[j] in held:
            j += 1
        if j >= k:
            return
        eh = [h ^ SALT for h in hs]
        parent = eh[j - 1] if j else None
        if via_batch:
            ev = BlockStored(eh[j:k], parent, p[j * BS:k * BS], BS)
            self.idx.apply_batch(key[0], decode_batch(encode_batch([ev], key[1])))
        else:
            self.idx.apply_stored(key, eh[j:k], parent, p[j * BS:k * BS], BS)
        held.update(dict.fromkeys(hs[j:k]))

    @rule(key=st.sampled_from(TOKEN_KEYS), data=st.data())
    def token_remove_leaf(self, key: WorkerKey, data: st.DataObject) -> None:
        held = self.held[key]
        leaves = [h for h in held if not any(PARENT[c] == h for c in held)]
        if leaves:
            h = data.draw(st.sampled_from(leaves))
            self.idx.apply_removed(key, [h ^ SALT])
            del held[h]

    @rule(w=st.sampled_from([1, 2, 3]))
    def remove_worker(self, w: int) -> None:
        self.idx.remove_worker(w)
        for key in self.held:
            if key[0] == w:
                self.held[key].clear()

    def index_sets(self) -> dict[WorkerKey, set[int]]:
        """Each key's own hashes as the index's masks hold them."""
        bits = {st_.bit: k for k, st_ in self.idx._state.items()}
        out: dict[WorkerKey, set[int]] = {k: set() for k in bits.values()}
        masks = self.idx._masks
        for h in NODES:
            m = masks.get(h, 0)
            for bit, k in bits.items():
                if m & bit:
                    out[k].add(h)
        return out

    @invariant()
    def agrees_with_model(self) -> None:
        sets = self.index_sets()
        for key, held in self.held.items():
            assert sets.get(key, set()) == set(held), key
            assert self.idx.num_blocks(key) == len(held), key
            if key in DELTA_KEYS and key in self.idx._state:  # holes drive the exact scan
                bit = self.idx._state[key].bit
                assert bool(self.idx._keys.dirty & bit) == (holes(held) > 0), key
        assert self.idx.num_blocks() == sum(map(len, self.held.values()))
        for p in PROMPTS:
            assert self.idx.find_matches(p) == brute_matches(self.held, p), p


class PackedDeltaMachine(DeltaMachine):
    def make_index(self) -> KvIndexer:
        return PackedKvIndexer(BS)


class PackedTinyFrontDeltaMachine(DeltaMachine):
    """The packed layout with a front of 2 hashes: stores merge it into the table mid-batch."""

    def make_index(self) -> KvIndexer:
        idx = PackedKvIndexer(BS)
        idx._packed_masks.front_max = 2
        return idx


CAP = 8


class CappedDeltaMachine(DeltaMachine):
    """Capped at ``CAP`` blocks, evicting the oldest: the index holds a subset of what the
    publishers hold, never more than the cap, and answers exactly for what it holds."""

    def make_index(self) -> KvIndexer:
        return KvIndexer(BS, max_blocks=CAP, evict_oldest=True)

    @invariant()
    def agrees_with_model(self) -> None:
        sets = self.index_sets()
        assert self.idx.num_blocks() <= CAP
        for key, held in self.held.items():
            assert sets.get(key, set()) <= set(held), key
            assert self.idx.num_blocks(key) == len(sets.get(key, ())), key
        for p in PROMPTS:
            assert self.idx.find_matches(p) == brute_matches(sets, p), p


class RefusingDeltaMachine(CappedDeltaMachine):
    def make_index(self) -> KvIndexer:
        return KvIndexer(BS, max_blocks=CAP)


class PackedCappedDeltaMachine(CappedDeltaMachine):
    def make_index(self) -> KvIndexer:
        return PackedKvIndexer(BS, max_blocks=CAP, evict_oldest=True)


class PackedRefusingDeltaMachine(CappedDeltaMachine):
    def make_index(self) -> KvIndexer:
        return PackedKvIndexer(BS, max_blocks=CAP)


_settings = settings(max_examples=120, stateful_step_count=30, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
for _m in (DeltaMachine, PackedDeltaMachine, PackedTinyFrontDeltaMachine, CappedDeltaMachine,
           RefusingDeltaMachine, PackedCappedDeltaMachine, PackedRefusingDeltaMachine):
    _m.TestCase.settings = _settings
test_deltas_match_brute_force_model = DeltaMachine.TestCase
test_packed_deltas_match_brute_force_model = PackedDeltaMachine.TestCase
test_capped_deltas_stay_under_cap_and_exact = CappedDeltaMachine.TestCase
test_refusing_cap_with_deltas = RefusingDeltaMachine.TestCase
test_packed_capped_deltas = PackedCappedDeltaMachine.TestCase
test_packed_deltas_through_a_tiny_front = PackedTinyFrontDeltaMachine.TestCase
test_packed_refusing_cap_with_deltas = PackedRefusingDeltaMachine.TestCase


# --- examples ------------------------------------------------------------------------------------


def test_a_64_block_store_is_one_update_and_eviction_poisons() -> None:
    idx = KvIndexer(BS, max_blocks=100, evict_oldest=True)
    toks = list(range(128))
    hs = block_hashes(toks, BS)
    send(idx, (1, 0), [OwnStored(hs)])
    assert idx.find_matches(toks) == {(1, 0): 64} and idx._keys.dirty == 0
    assert idx._state[(1, 0)].e2o == {} and idx.num_blocks() == 64
    other = block_hashes([t + 1000 for t in toks], BS)
    send(idx, (2, 0), [OwnStored(other)])  # 128 > 100: (1, 0), the largest, loses its oldest
    assert idx.num_blocks() <= 100 and idx.stats.evicted >= 28 and idx.stats.refused == 0
    assert idx.find_matches(toks) == {}  # its roots went first: nothing leads any more
    assert idx._keys.dirty & idx._state[(1, 0)].bit  # scanned exactly from now on
    idx.clear((1, 0))
    assert not idx._keys.dirty & idx._state[(1, 0)].bit and idx.num_blocks((1, 0)) == 0


def test_a_key_switches_form_with_a_clear() -> None:
    idx = KvIndexer(BS)
    toks = [0, 0, 1, 1]
    idx.apply_stored((1, 0), [10, 11], None, toks, BS)
    send(idx, (1, 0), [OwnStored(block_hashes(toks, BS)[:1])])  # the token blocks go first
    assert idx.find_matches(toks) == {(1, 0): 1} and idx.num_blocks() == 1
    idx.apply_stored((1, 0), [10, 11], None, toks, BS)  # and back
    assert idx.find_matches(toks) == {(1, 0): 2} and idx.num_blocks() == 2


# --- malformed payloads --------------------------------------------------------------------------

_enc = msgspec.msgpack.encode
GARBAGE = [
    b"", b"\xc1", b"\x93", b"not msgpack at all", _enc([]), _enc({"ts": 1}),
    _enc([1.0, [{"type": "OwnStored", "own_hashes": ["x"]}], 0]),
    _enc([1.0, [{"type": "OwnStored", "own_hashes": [1, 2], "holes": -1}], 0]),
    _enc([1.0, [{"type": "OwnStored", "own_hashes": [1], "holes": "2"}], 0]),
    _enc([1.0, [{"type": "OwnStored"}], 0]),
    _enc([1.0, [{"type": "OwnEvicted", "own_hashes": [1]}], 0]),
    _enc([1.0, [["OwnStored", [1, 2]]], 0]),
    _enc([1.0, [{"type": "OwnRemoved", "own_hashes": 5}], 0]),
    _enc([1.0, [{"type": "OwnRemoved", "own_hashes": [1.5]}], 0]),
    _enc([1.0, [{"type": "OwnStored", "own_hashes": [1]}], "rank"]),
    _enc(["ts", [], 0]),
    b"\x91" * 100_000,  # deeply nested arrays
    encode_batch([BlockStored([1], None, [0, 0], BS, own_hashes=[5])], 0),  # the stores form
]


@pytest.mark.parametrize("payload", GARBAGE)
def test_malformed_delta_payloads_raise_event_decode_error(payload: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_own_batch(payload)


@pytest.mark.parametrize("layout", [KvIndexer, PackedKvIndexer])
def test_stored_counts_and_signed_hashes_index_harmlessly(layout: type[KvIndexer]) -> None:
    batch, stored = decode_own_batch(_enc([2.0, [
        {"type": "OwnStored", "own_hashes": [-1, 5], "holes": 1},
        {"type": "OwnRemoved", "own_hashes": [5]}, {"type": "AllBlocksCleared"}], None]))
    assert stored == 2 and batch.dp_rank is None
    assert batch.events[0] == OwnStored([-1, 5], 1)
    idx = layout(BS)
    idx.apply_batch(1, batch)  # ends cleared
    assert idx.num_blocks() == 0 and not idx._masks
    send(idx, (1, 0), [OwnStored([-1, 7], 1)])  # a bug, but no prompt hashes to it
    assert idx.find_matches(PROMPTS[0]) == {} and idx.num_blocks() == 2
    send(idx, (1, 0), [OwnStored([-1], 1)])  # stored twice: a duplicate
    assert idx.num_blocks() == 2 and idx.stats.duplicate_stores == 1
    send(idx, (1, 0), [OwnRemoved([-1, 7], 0)])
    assert idx.num_blocks() == 0 and not idx._masks


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200) | st.builds(
    lambda b, i, x: b[:i] + bytes([x]) + b[i + 1:],
    st.sampled_from([encode_own_batch([OwnStored([1, 2, 3], 1), OwnRemoved([2], 2),
                                       AllBlocksCleared()], 0, 1.0)]),
    st.integers(0, 40), st.integers(0, 255)))
def test_any_bytes_decode_or_raise_event_decode_error(payload: bytes) -> None:
    try:
        batch, _ = decode_own_batch(payload)
    except EventDecodeError:
        return
    idx = KvIndexer(BS)  # whatever decodes applies without error
    idx.apply_batch(1, batch)


# --- through a real subscriber on real ZMQ sockets -----------------------------------------------

WID = 0xDE17A


def _raw(pub: KvEventPublisher, payload: bytes) -> None:
    """Publish ``payload`` as the next batch, whatever it holds (seq, replay buffer, PUB)."""
    seq = pub._next_seq
    pub._next_seq += 1
    pub._buffer.append((seq, payload))
    assert pub._pub is not None
    pub._pub.send_multipart([pub.topic, seq.to_bytes(8, "big"), payload])


def _stores(hashes: list[int], parent: int | None = None) -> BlockStored:
    """A vLLM-shaped store with own hashes (what the mocker hands its publisher)."""
    return BlockStored([h ^ SALT for h in hashes], parent, [], BS, own_hashes=hashes)


async def _following(pub: KvEventPublisher, idx: KvIndexer,
                     metrics: RouterMetrics | None = None) -> KvEventSubscriber:
    sub = KvEventSubscriber(Resources("test"), WID, f"tcp://127.0.0.1:{pub.events_port}", idx,
                            replay_endpoint=f"tcp://127.0.0.1:{pub.replay_port}",
                            metrics=metrics, model="m", replay_timeout=2.0, edge_hashed=True,
                            deltas=True)
    sub.start()
    return sub


async def test_a_dump_in_delta_form_replaces_stale_state_and_garbage_is_counted() -> None:
    pub = KvEventPublisher("127.0.0.1", form=FORM_DELTAS)
    await pub.start()
    idx = KvIndexer(BS)
    a, b = block_hashes(PROMPTS[5], BS), block_hashes(PROMPTS[10], BS)
    try:
        # What the worker holds: rank 0 a 4-block chain, rank 1 a chain with its root removed.
        pub.publish([_stores(a)], 0)
        pub.publish([_stores(b)], 1)
        pub.publish([BlockRemoved([b[0] ^ SALT])], 1)
        # A router that followed this worker before, with what it held then (now stale).
        stale = block_hashes(PROMPTS[12], BS)
        send(idx, (WID, 0), [OwnStored(stale)])
        send(idx, (WID, 1), [OwnStored(stale[:2])])
        metrics = RouterMetrics()
        sub = await _following(pub, idx, metrics)
        assert await sub.wait_for_seq(pub.next_seq - 1)
        assert sub.stats.snapshots == 1 and sub.stats.edge_hashed_blocks == 7
        assert idx.find_matches(PROMPTS[5]) == {(WID, 0): 4}
        assert idx.find_matches(PROMPTS[12]) == {}  # the stale blocks are gone
        assert idx.find_matches(PROMPTS[10]) == {}  # rank 1 lacks the root: a hole
        assert idx.num_blocks((WID, 1)) == 3 and idx._keys.dirty == idx._state[(WID, 1)].bit
        # Garbage among live batches: counted, skipped, the next batch applies.
        for payload in GARBAGE[:6]:
            _raw(pub, payload)
        pub.publish([_stores([b[0]])], 1)
        assert await sub.wait_for_seq(pub.next_seq - 1)
        assert sub.stats.decode_errors == 6 and sub.running
        assert idx.find_matches(PROMPTS[10]) == {(WID, 1): 4} and idx._keys.dirty == 0
        assert metrics.decode_errors.labels("m")._value.get() == 6
        assert metrics.edge_hashed_blocks.labels("m")._value.get() == 8
        await sub.close()
        assert idx.keys() == set() and idx.num_blocks() == 0 and not idx._masks
    finally:
        await pub.close()


def test_a_deltas_advert_with_another_scheme_is_not_indexed() -> None:
    """Without a usable scheme (block size, seed...) the subscriber keeps the token decoder, so
    a deltas publisher's payloads are counted as undecodable, never indexed as something else."""
    payload = encode_own_batch([OwnStored(block_hashes(PROMPTS[0], BS))], 0)
    assert pick_decoder(True, True)(payload)[1] == 4
    with pytest.raises(EventDecodeError):
        pick_decoder(False, True)(payload)
    with pytest.raises(EventDecodeError):
        pick_decoder(True, False)(payload)
