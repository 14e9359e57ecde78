"""A mocker worker that publishes own-hash deltas (``kv_hash_scheme.form = "deltas"``), for the
router's tests of that form while the engines still publish the stores form::

    python -m tests.support.delta_worker [worker and mocker flags...]

The real mocker runs as ``python -m dynamo_zmq.worker --engine mocker`` would, except that its
publisher is ``DeltaPublisher``: each batch of vLLM-shaped events (with the own hashes the mocker
computes at the edge) goes through a small per-rank ledger and leaves as an ``OwnBatch`` on the
same PUB socket (same seqs, same replay buffer); a full dump is ``OwnStored`` events of every
held own hash, parents first, with the rank's ``holes``. The worker advertises the deltas form.
"""

from __future__ import annotations

import sys

import zmq

import engines.mocker._engine as mocker_engine
from dynamo_zmq.llm import (
    AllBlocksCleared,
    BlockStored,
    KvEvent,
    KvHashScheme,
    OwnEvent,
    OwnRemoved,
    OwnStored,
    encode_own_batch,
)
from dynamo_zmq.llm._block_hashing import FORM_DELTAS
from dynamo_zmq.worker import run
from engines.mocker import MockerEngine
from engines.mocker._publisher import KvEventPublisher


class RankLedger:
    """Own hashes one rank holds: references per own hash, engine hash -> (own hash, stores)."""

    def __init__(self) -> None:
        self.e2o: dict[int, list[int]] = {}  # engine hash -> [own hash, stores]
        self.refs: dict[int, int] = {}  # own hash -> references (insertion order: parents first)
        self.parent: dict[int, int | None] = {}  # own hash -> parent own hash

    def holes(self) -> int:
        return sum(1 for o in self.refs if (p := self.parent.get(o)) is not None
                   and p not in self.refs)

    def apply(self, ev: KvEvent) -> OwnEvent | None:
        if isinstance(ev, AllBlocksCleared):
            self.e2o, self.refs, self.parent = {}, {}, {}
            return ev
        if isinstance(ev, BlockStored):
            if ev.own_hashes is None or len(ev.own_hashes) != len(ev.block_hashes):
                return None
            prev: int | None = None
            if ev.parent_block_hash is not None:
                got = self.e2o.get(ev.parent_block_hash)
                if got is None:
                    return None  # cannot tell what it chains from: not published
                prev = got[0]
            stored = []
            for eh, oh in zip(ev.block_hashes, ev.own_hashes, strict=True):
                entry = self.e2o.get(eh)
                if entry is not None:
                    entry[1] += 1
                else:
                    self.e2o[eh] = [oh, 1]
                    self.parent.setdefault(oh, prev)
                    self.refs[oh] = self.refs.get(oh, 0) + 1
                    if self.refs[oh] == 1:
                        stored.append(oh)
                prev = oh
            return OwnStored(stored, self.holes()) if stored else None
        removed = []
        for eh in ev.block_hashes:
            entry = self.e2o.get(eh)
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1]:
                continue
            del self.e2o[eh]
            oh = entry[0]
            self.refs[oh] -= 1
            if not self.refs[oh]:
                del self.refs[oh]
                removed.append(oh)
        return OwnRemoved(removed, self.holes()) if removed else None


class DeltaPublisher(KvEventPublisher):
    """``KvEventPublisher`` sending ``OwnBatch`` payloads (see the module docstring)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.ledgers: dict[int, RankLedger] = {}

    def publish(self, events: list[KvEvent], dp_rank: int) -> int:
        ledger = self.ledgers.setdefault(dp_rank, RankLedger())
        own = [o for o in map(ledger.apply, events) if o is not None]
        seq = self._next_seq
        self._next_seq += 1
        payload = encode_own_batch(own, dp_rank)
        self._buffer.append((seq, payload))
        if self._pub is not None:
            try:
                self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
            except zmq.ZMQError:
                self.dropped += 1
        return seq

    def _snapshot(self, prefix: list[bytes]) -> list[list[bytes]]:
        if self._next_seq == 0:
            return []
        seq = (self._next_seq - 1).to_bytes(8, "big")
        return [[*prefix, self.topic, seq,
                 encode_own_batch([OwnStored(list(ledger.refs), ledger.holes())], rank)]
                for rank, ledger in sorted(self.ledgers.items())]


class DeltaMocker(MockerEngine):
    """The mocker, advertising the deltas form of the router's scheme."""

    def _hash_scheme(self) -> KvHashScheme:
        return KvHashScheme.ours(self.config.block_size, FORM_DELTAS)


if __name__ == "__main__":
    mocker_engine.KvEventPublisher = DeltaPublisher  # type: ignore[misc]
    engine, config = DeltaMocker.from_args(sys.argv[1:])
    sys.exit(run(engine, config))
