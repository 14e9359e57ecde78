"""``OwnHashLedger`` (issue 18, item 1) against a brute-force model: random store / remove / clear
sequences with duplicate engine hashes, several engine hashes sharing an own hash, unknown
parents and unknown removals. The published deltas replayed into a set equal the model's held
own hashes, ``holes`` equals the model's count after each event, every stored hash is new and
every removed one held, stores come parents first, and a snapshot replays to the same state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamo_zmq.llm import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    OwnEvent,
    OwnHashLedger,
    OwnRemoved,
    OwnStored,
)

# Own hashes are interned (parent own, token): a chained hash, so an own hash has one parent.
_interned: dict[tuple[int | None, int], int] = {}
_parent_of: dict[int, int | None] = {}


def _own(parent: int | None, token: int) -> int:
    key = (parent, token)
    if key not in _interned:
        _interned[key] = h = 1_000 + len(_interned)
        _parent_of[h] = parent
    return _interned[key]


@dataclass
class Model:
    """Per engine hash: how many stores minus removals, and the first store's own hash."""

    count: dict[int, int] = field(default_factory=dict)
    own: dict[int, int] = field(default_factory=dict)

    def store(self, parent_eh: int | None, blocks: list[tuple[int, int]]) -> list[int] | None:
        """Own hashes of the blocks ((engine hash, token)), None when the parent is unknown."""
        if parent_eh is None:
            parent = None
        elif parent_eh in self.own:
            parent = self.own[parent_eh]
        else:
            return None
        owns = []
        for eh, tok in blocks:
            oh = _own(parent, tok)
            owns.append(oh)
            if eh in self.count:
                self.count[eh] += 1
                parent = self.own[eh]
            else:
                self.count[eh], self.own[eh] = 1, oh
                parent = oh
        return owns

    def remove(self, ehs: list[int]) -> None:
        for eh in ehs:
            if eh in self.count:
                self.count[eh] -= 1
                if not self.count[eh]:
                    del self.count[eh], self.own[eh]

    def held(self) -> set[int]:
        return set(self.own.values())

    def holes(self) -> int:
        held = self.held()
        return sum(1 for h in held if _parent_of[h] is not None and _parent_of[h] not in held)


ENGINE = st.integers(0, 12)
steps = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.one_of(st.none(), ENGINE),
                  st.lists(st.tuples(ENGINE, st.integers(0, 2)), min_size=1, max_size=5),
                  st.booleans()),
        st.tuples(st.just("remove"), st.lists(ENGINE, min_size=1, max_size=4)),
        st.tuples(st.just("clear")),
    ),
    max_size=40,
)


def _replay(held: set[int], holes_seen: list[int], events: list[OwnEvent]) -> None:
    for ev in events:
        if isinstance(ev, OwnStored):
            for h in ev.own_hashes:
                assert h not in held, "a stored own hash must be new to the rank"
                p = _parent_of[h]
                if p is not None and p in ev.own_hashes:
                    assert ev.own_hashes.index(p) < ev.own_hashes.index(h), "parents first"
                held.add(h)
        elif isinstance(ev, OwnRemoved):
            for h in ev.own_hashes:
                assert h in held, "a removed own hash must be held"
                held.remove(h)
        else:
            held.clear()
        holes_seen.append(0 if isinstance(ev, AllBlocksCleared) else ev.holes)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps)
def test_deltas_replay_to_the_models_state(script: list[tuple[Any, ...]]) -> None:
    ledger, model = OwnHashLedger(), Model()
    held: set[int] = set()
    for step in script:
        events: list[KvEvent]
        if step[0] == "store":
            _, parent_eh, blocks, with_owns = step
            snapshot = (dict(model.count), dict(model.own))
            owns = model.store(parent_eh, blocks)
            if owns is None or not with_owns:  # not hashed exactly: the ledger leaves it out
                model.count, model.own = snapshot
            events = [BlockStored([eh for eh, _ in blocks], parent_eh,
                                  [t for _, t in blocks], 1,
                                  own_hashes=owns if with_owns else None)]
        elif step[0] == "remove":
            model.remove(step[1])
            events = [BlockRemoved(step[1])]
        else:
            model.count.clear()
            model.own.clear()
            events = [AllBlocksCleared()]
        out = ledger.apply(events)
        holes: list[int] = []
        _replay(held, holes, out)
        assert held == model.held() == ledger.held()
        assert ledger.holes == model.holes()
        if out:
            assert holes[-1] == model.holes()
        dump: set[int] = set()
        dump_holes: list[int] = []
        _replay(dump, dump_holes, ledger.snapshot(per_event=3))
        assert dump == model.held()
        assert (dump_holes[-1] if dump_holes else 0) == model.holes()


def test_a_batch_merges_runs_and_keeps_holes_per_event() -> None:
    """Stores of one batch become one ``OwnStored``; a duplicate engine hash needs two removals;
    removing a parent makes its held child a hole."""
    ledger = OwnHashLedger()
    a, b, c = _own(None, 7), _own(_own(None, 7), 8), _own(None, 9)
    out = ledger.apply([
        BlockStored([1], None, [7], 1, own_hashes=[a]),
        BlockStored([2], 1, [8], 1, own_hashes=[b]),
        BlockStored([3], None, [7], 1, own_hashes=[a]),  # another engine block, same own hash
        BlockStored([4], None, [9], 1, own_hashes=[c]),
        BlockStored([4], None, [9], 1, own_hashes=[c]),  # duplicate of engine hash 4
    ])
    assert out == [OwnStored([a, b, c], 0)]
    assert ledger.apply([BlockRemoved([1])]) == []  # engine block 3 still holds a
    assert ledger.apply([BlockRemoved([3, 4])]) == [OwnRemoved([a], 1)]
    assert ledger.apply([BlockRemoved([4])]) == [OwnRemoved([c], 1)]
    assert ledger.snapshot() == [OwnStored([b], 1)]
    assert ledger.apply([AllBlocksCleared()]) == [AllBlocksCleared()]
    assert ledger.snapshot() == [] and ledger.holes == 0
