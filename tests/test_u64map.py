"""router._u64map.U64Map and router._e2o.E2OTable against dicts: scalar and vectorized
operations, collisions (keys sharing a home slot), growth, tombstones, insertion order and the
reserved keys 0 and 1."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from router._e2o import E2OTable
from router._probe import SMALL, any_held, find, place
from router._u64map import U64Map

MASK64 = (1 << 64) - 1


def _colliding(n: int, bits: int = 3) -> list[int]:
    """``n`` keys with the same home slot in a 2**bits table (and in bigger ones, mostly)."""
    out, k = [], 2
    while len(out) < n:
        if (k ^ k >> 32) & ((1 << bits) - 1) == 0:
            out.append(k)
        k += 1
    return out


# A small pool (so keys repeat: updates, deletes of present keys, re-inserts over tombstones)
# mixing the reserved keys, colliding keys, small ints and full-range 64-bit values.
POOL = [0, 1, *_colliding(12), 2, 3, 4, 5, 1 << 63, MASK64, MASK64 - 1, 0x1234_5678_9ABC_DEF0]
keys_st = st.sampled_from(POOL) | st.integers(0, MASK64)
vals_st = st.integers(0, MASK64)


class MapVsDict(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = U64Map()
        self.d: dict[int, int] = {}

    @rule(k=keys_st, v=vals_st)
    def set(self, k: int, v: int) -> None:
        self.m.set(k, v)
        self.d[k] = v

    @rule(k=keys_st)
    def pop(self, k: int) -> None:
        assert self.m.pop(k, -1) == self.d.pop(k, -1)

    @rule(k=keys_st)
    def get(self, k: int) -> None:
        assert self.m.get(k, 7) == self.d.get(k, 7)
        assert (k in self.m) == (k in self.d)

    @rule(kv=st.dictionaries(keys_st, vals_st, max_size=40))
    def put_many(self, kv: dict[int, int]) -> None:
        self.m.put_many(np.array(list(kv), dtype=np.uint64),
                        np.array(list(kv.values()), dtype=np.uint64))
        self.d.update(kv)

    @rule(kv=st.dictionaries(keys_st, vals_st, max_size=40))
    def or_many(self, kv: dict[int, int]) -> None:
        old = self.m.or_many(np.array(list(kv), dtype=np.uint64),
                             np.array(list(kv.values()), dtype=np.uint64))
        assert old.tolist() == [self.d.get(k, 0) for k in kv]
        for k, v in kv.items():
            self.d[k] = self.d.get(k, 0) | v

    @rule(ks=st.lists(keys_st, max_size=40, unique=True))
    def delete_many(self, ks: list[int]) -> None:
        gone = self.m.delete_many(np.array(ks, dtype=np.uint64))
        assert gone == sum(self.d.pop(k, None) is not None for k in ks)

    @rule(ks=st.lists(keys_st, max_size=40))
    def get_many(self, ks: list[int]) -> None:
        vals, found = self.m.get_many(np.array(ks, dtype=np.uint64))
        assert found.tolist() == [k in self.d for k in ks]
        assert vals.tolist() == [self.d.get(k, 0) for k in ks]

    @rule()
    def clear(self) -> None:
        self.m.clear()
        self.d.clear()

    @invariant()
    def same(self) -> None:
        assert len(self.m) == len(self.d)
        assert dict(self.m.items()) == self.d
        # The table never fills: probes always end at an empty slot.
        assert self.m._filled * 4 <= self.m.capacity() * 3


TestMapVsDict = MapVsDict.TestCase
TestMapVsDict.settings = settings(max_examples=150, stateful_step_count=60, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])


def test_growth_and_tombstone_churn() -> None:
    """Many inserts (growth) and delete/insert churn (tombstones, same-size rebuilds)."""
    m, d = U64Map(), {}
    rng = np.random.default_rng(5)
    keys = rng.integers(0, 2**64 - 1, 20_000, dtype=np.uint64, endpoint=True)
    keys = np.unique(keys)
    m.put_many(keys, keys ^ np.uint64(7))
    d.update(zip(keys.tolist(), (keys ^ np.uint64(7)).tolist(), strict=True))
    for start in range(0, len(keys), 1000):
        part = keys[start:start + 500]
        assert m.delete_many(part) == len(part)
        for k in part.tolist():
            del d[k]
        fresh = rng.integers(2, 2**64 - 1, 500, dtype=np.uint64)
        fresh = np.setdiff1d(fresh, np.array(list(d), dtype=np.uint64))
        for k in fresh.tolist():
            m.set(k, 1)
            d[k] = 1
    assert len(m) == len(d) and dict(m.items()) == d
    vals, found = m.get_many(keys)
    assert vals[found].tolist() == [d[k] for k in keys[found].tolist()]
    assert found.tolist() == [k in d for k in keys.tolist()]
    assert m._filled * 4 <= m.capacity() * 3


# --- router._e2o.E2OTable: the dict API in packed ints, insertion order, bulk inserts ----------

PACKED_ST = st.builds(
    lambda own, parent, hp, children: own | parent << 64 | hp << 128 | children << 129,
    vals_st, vals_st, st.integers(0, 1), st.integers(0, (1 << 31) - 1))


class E2OVsDict(RuleBasedStateMachine):
    """Against a dict of packed ints (which keeps insertion order, as eviction needs)."""

    def __init__(self) -> None:
        super().__init__()
        self.t = E2OTable()
        self.d: dict[int, int] = {}

    @rule(k=keys_st, p=PACKED_ST)
    def set(self, k: int, p: int) -> None:
        self.t[k] = p
        self.d[k] = p

    @rule(k=keys_st)
    def pop(self, k: int) -> None:
        assert self.t.pop(k) == self.d.pop(k, None)

    @rule(k=keys_st)
    def get(self, k: int) -> None:
        assert self.t.get(k) == self.d.get(k)
        assert self.t.own(k) == (self.d[k] & MASK64 if k in self.d else -1)
        assert (k in self.t) == (k in self.d)

    @rule(k=keys_st, n=st.integers(-3, 3))
    def add_children(self, k: int, n: int) -> None:
        if k in self.d and 0 <= (self.d[k] >> 129) + n < 1 << 31:
            self.t.add_children(k, n)
            self.d[k] += n << 129

    @rule(new=st.dictionaries(keys_st, PACKED_ST, max_size=20), repeat=st.booleans())
    def add_new(self, new: dict[int, int], repeat: bool) -> None:
        """The token path's store: a check that none is held, then the front."""
        fresh = [k for k in new if k not in self.d]
        assert self.t.holds_any(list(new)) == (len(fresh) != len(new))
        ehs = fresh + fresh[:1] if repeat else fresh
        ok = self.t.add_new(ehs, [new[k] for k in ehs])
        assert ok == (not (repeat and fresh))
        if ok:
            self.d.update((k, new[k]) for k in fresh)

    @rule()
    def merge(self) -> None:
        self.t.merge()
        assert not self.t.front

    @rule(new=st.dictionaries(keys_st, PACKED_ST, max_size=40))
    def insert_many(self, new: dict[int, int]) -> None:
        new = {k: p for k, p in new.items() if k not in self.d}
        ps = list(new.values())
        self.t.insert_many(np.array(list(new), dtype=np.uint64),
                           np.array([p & MASK64 for p in ps], dtype=np.uint64),
                           np.array([(p >> 64) & MASK64 for p in ps], dtype=np.uint64),
                           np.array([(p >> 128) & 1 | (p >> 129) << 1 for p in ps],
                                    dtype=np.uint64))
        found = self.t.find_many(np.array(list(new), dtype=np.uint64))
        assert (found >= 0).all()
        self.d.update(new)

    @invariant()
    def same(self) -> None:
        assert len(self.t) == len(self.d)
        assert list(self.t.items()) == list(self.d.items())  # insertion order too
        assert list(self.t) == list(self.d)
        assert sorted(self.t.owns().tolist()) == sorted(p & MASK64 for p in self.d.values())
        assert self.t._filled * 5 <= (self.t._mask + 1) * 4


class E2OTinyFrontVsDict(E2OVsDict):
    """A front of 3 entries: merges run in the middle of stores."""

    def __init__(self) -> None:
        super().__init__()
        self.t = E2OTable(front_max=3)


TestE2OVsDict = E2OVsDict.TestCase
TestE2OTinyFrontVsDict = E2OTinyFrontVsDict.TestCase
for _case in (TestE2OVsDict, TestE2OTinyFrontVsDict):
    _case.settings = settings(max_examples=150, stateful_step_count=60, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])


def test_e2o_insertion_order_survives_growth_and_seq_renumbering() -> None:
    """Oldest-first order (what eviction walks) through growth, churn and a renumbering."""
    t, d = E2OTable(), {}
    for i in range(3000):
        t[i * 7 + 2] = i
        d[i * 7 + 2] = i
        if i % 3 == 0:
            k = (i // 2) * 7 + 2
            assert t.pop(k) == d.pop(k, None)
    t._rehash(0)  # renumbers the insertion order from 0
    t[5] = 1
    d[5] = 1
    assert list(t) == list(d) and dict(t.items()) == d


# --- router._probe: both round kinds, both slot markings -------------------------------------


@pytest.mark.parametrize("marking", ["sentinel", "state"])
def test_probe_places_and_finds_racing_and_colliding_keys(marking: str) -> None:
    """More than ``SMALL`` keys (rounds of one slot, racing claims) that mostly share a home
    slot (long runs, then window rounds), into a table with live and deleted slots."""
    bits = 12
    mask = (1 << bits) - 1
    rng = np.random.default_rng(3)
    kv = np.zeros(1 << bits, dtype=np.uint64)
    state = None if marking == "sentinel" else np.zeros(1 << bits, dtype=np.uint8)
    old = np.array(_colliding(300, bits)[:100] + rng.integers(2, 2**63, 500).tolist(),
                   dtype=np.uint64)
    old = np.unique(old)
    old_slots, _ = place(kv, old, mask, state)
    gone = old_slots[::3]  # delete a third: tombstones the next keys may reuse
    if state is None:
        kv[gone] = 1
    else:
        state[gone] = 2
    new = np.array(_colliding(300, bits)[100:] + rng.integers(2, 2**63, 600).tolist(),
                   dtype=np.uint64)
    new = np.setdiff1d(np.unique(new), old)
    assert len(new) > SMALL
    slots, reused = place(kv, new, mask, state)
    assert len(set(slots.tolist())) == len(new) and (kv[slots] == new).all()
    assert reused == len(set(slots.tolist()) & set(gone.tolist()))
    assert (find(kv, new, mask, state) == slots).all()
    live_old = np.delete(old, np.arange(0, len(old), 3))
    assert (find(kv, live_old, mask, state) >= 0).all()
    assert (find(kv, old[::3], mask, state) == -1).all()
    # any_held: colliding keys never stored (their home's run is hundreds of slots: several
    # windows), deleted ones (a state table keeps their key in the slot), random absent ones.
    absent = np.setdiff1d(np.array(_colliding(340, bits)[300:] + rng.integers(2, 2**63, 60)
                                   .tolist(), dtype=np.uint64), np.concatenate([old, new]))
    assert not any_held(kv, np.concatenate([absent, old[::3]]), mask, state)
    for k in [*new[:40].tolist(), *new[-40:].tolist(), *live_old[:40].tolist()]:
        assert any_held(kv, np.array([*absent[:8].tolist(), k], dtype=np.uint64), mask, state)
    # Each key sits at the first slot of its probe sequence that was free when it was placed:
    # no key's run from home to its slot crosses an empty slot.
    occupied = kv > 1 if state is None else state != 0
    for k, s in zip(new.tolist(), slots.tolist(), strict=True):
        h = (k ^ k >> 32) & mask
        run = [(h + i) & mask for i in range((s - h) & mask)]
        assert occupied[run].all()
