"""The KV index on packed integer tables: ``PackedKvIndexer``, a ``KvIndexer`` with no
per-entry Python objects (issue 18, item 2): the router's default layout.

Same rules, events and answers as ``KvIndexer`` (the same brute-force property tests run on
both); only the containers differ: the own hash -> key bitmask map is a ``MaskMap``
(``router._masks``, 16 B a slot) and each key's engine hash -> entry map an ``E2OTable``
(``router._e2o``, 33 B a slot), both open addressing over ``array('Q')`` columns.

Both tables take new entries in a plain dict first, their *front*, merged in bulk: a token
event's store is a dict update into the key's ``E2OTable`` front plus the masks' front
(``MaskMap.add_bit``), after one vectorized probe that none of its engine hashes is held
(``E2OTable.holds_any``). An own hash the key already held under another engine hash (a twin,
``st.shared``) is found when the masks merge or settle it (``_settle_dups``); a removal settles
its own hash first (``KvIndexer._settle_own``). A batch of independent edge-hashed stores goes
all at once (``router._batch_store``); the rest (duplicates, conflicts, orphans, removals,
eviction) runs ``KvIndexer``'s code block by block through the tables' dict API. Stores cost
about twice ``KvIndexer``'s (docs/benchmarks.md has the figures).
"""

from __future__ import annotations

import array
import itertools
import operator
import sys
from collections.abc import Sequence
from typing import Any, cast

import xxhash

from ._batch_store import store_batch
from ._e2o import FRONT_MAX as E2O_FRONT_MAX
from ._e2o import E2OTable
from ._keystate import HAS_PARENT, KeyState, chain_entries
from ._masks import MaskMap
from .events import EventBatch, OwnBatch
from .hashing import ROOT_SEED, event_own_hashes, root_hash
from .indexer import DEFAULT_MAX_BLOCKS, IndexerStats, KvIndexer
from .matching import WorkerKey, linear_matches, prefix_matches

__all__ = ["PackedKvIndexer"]

_NO_EXTRA = [None]
_and = operator.and_
_h64 = xxhash.xxh3_64_intdigest


def _zeros(n: int) -> itertools.repeat[int]:
    return itertools.repeat(0, n)


class _Getter:
    """A ``dict``-shaped view of the masks for ``router.matching`` (only ``get`` is read)."""

    __slots__ = ("get",)

    def __init__(self, masks: MaskMap) -> None:
        self.get = masks.getter()


class PackedKvIndexer(KvIndexer):
    """``KvIndexer`` on packed tables (see the module docstring); same arguments."""

    def __init__(self, block_size: int, max_blocks: int = DEFAULT_MAX_BLOCKS, *,
                 evict_oldest: bool = False) -> None:
        super().__init__(block_size, max_blocks, evict_oldest=evict_oldest)
        # The dict API KvIndexer's code (and its helpers, through the core) reads.
        self._masks = self._core.masks = cast(dict[int, int], MaskMap())
        self._packed_masks = cast(MaskMap, self._masks)
        self._packed_masks.on_dup = self._settle_dups
        self._settle_own = self._packed_masks.settle  # a removal reads exact twin counts
        #: Each key's engine hash table merges its front at this many entries (``E2OTable``).
        self.e2o_front_max = E2O_FRONT_MAX

    def _settle_dups(self, own: int, bits: int) -> None:
        """Each of ``bits`` is a key whose store of ``own``, which it already held, went to the
        masks' front (``router._masks``). A delta key counted it as a new block: it is a
        duplicate. A token key stored a new engine block: it is one more engine hash of
        ``own`` (``st.shared``)."""
        stats, bit_keys, states = self._stats, self._bit_keys, self._state
        while bits:
            bit = bits & -bits
            bits ^= bit
            st = states[bit_keys[bit]]
            if not st.delta:
                st.shared[own] = st.shared.get(own, 0) + 1
                continue
            st.count -= 1
            self._core.total -= 1
            stats.stored_blocks -= 1
            stats.duplicate_stores += 1

    @property
    def stats(self) -> IndexerStats:
        """``KvIndexer.stats``, after the masks' front is merged (its duplicates counted)."""
        self._packed_masks.merge()
        return self._stats

    def num_blocks(self, key: WorkerKey | None = None) -> int:
        """``KvIndexer.num_blocks``, after the masks' front is merged."""
        self._packed_masks.merge()
        return super().num_blocks(key)

    def _add_key(self, key: WorkerKey) -> KeyState:
        st = self._keys.add(key)
        if not isinstance(st.e2o, E2OTable):
            st.e2o = cast(dict[int, int], E2OTable(self.e2o_front_max))
        return st

    def apply_batch(self, worker_id: int, batch: EventBatch | OwnBatch) -> None:
        """``KvIndexer.apply_batch``; a batch of independent edge-hashed stores at once."""
        if type(batch) is EventBatch and len(batch.events) > 1:
            key = (worker_id, batch.dp_rank or 0)
            st = self._state.get(key) or self._add_key(key)  # as apply_stored does
            if store_batch(self._core, self._packed_masks, st, self.block_size, batch.events):
                return
        super().apply_batch(worker_id, batch)

    def apply_stored(self, key: WorkerKey, engine_hashes: list[int],
                     parent_engine_hash: int | None, token_ids: Sequence[int], block_size: int,
                     *, lora: int | str | None = None,
                     extra_keys: list[Any] | None = None,
                     own_hashes: list[int] | None = None) -> None:
        """``KvIndexer.apply_stored`` on the packed tables (same arguments, same index).
        """
        stats, core = self._stats, self._core
        st = self._state.get(key) or self._add_key(key)
        if st.delta:
            self._clear(key)
        n = len(engine_hashes)
        if block_size != self.block_size:
            stats.block_size_mismatch += 1
            return
        if len(token_ids) != n * block_size if own_hashes is None else len(own_hashes) != n:
            stats.bad_length += 1
            return
        if n == 0:
            return
        e2o = cast(E2OTable, st.e2o)
        if parent_engine_hash is None:
            seed = ROOT_SEED if lora is None else root_hash(lora)
        else:
            seed = e2o.own(parent_engine_hash)
            if seed < 0:
                stats.unknown_parent += 1
                return
        if core.total + n > core.max_blocks:
            self._packed_masks.merge()  # exact counts before the cap's arithmetic
        if core.total + n > core.max_blocks and core.evict_oldest:
            self._evictor.evict(key, core.total + n - core.max_blocks, parent_engine_hash,
                                engine_hashes)
        if n == 1 and (own_hashes is not None or extra_keys is None or extra_keys == _NO_EXTRA):
            eh = engine_hashes[0]
            if eh not in e2o and core.total < core.max_blocks and eh not in st.orphan_parents:
                # Fast path for one-block events (most of vLLM's during decode).
                try:
                    oh = (own_hashes[0] if own_hashes is not None
                          else _h64(array.array("I", token_ids).tobytes(), seed))
                except (OverflowError, TypeError):
                    stats.bad_tokens += 1
                    return
                if parent_engine_hash is None:
                    e2o.put_new(eh, oh)
                else:
                    e2o.put_new(eh, oh | parent_engine_hash << 64 | HAS_PARENT)
                    e2o.add_children(parent_engine_hash, 1)
                core.total += 1
                stats.stored_blocks += 1
                if st.bit >> 64 == 0:  # through the masks' front, as below
                    if not self._packed_masks.add_one(st.bit, oh):
                        st.shared[oh] = st.shared.get(oh, 0) + 1
                    return
                masks, bit = self._packed_masks, st.bit
                m = masks.get(oh, 0)
                if m & bit:
                    st.shared[oh] = st.shared.get(oh, 0) + 1
                else:
                    masks[oh] = m | bit if m else bit
                return
        try:
            maybe = event_own_hashes(token_ids, block_size, seed, n, own_hashes, extra_keys)
        except ValueError:
            stats.bad_tokens += 1
            return
        if maybe is None:
            stats.bad_length += 1
            return
        owns = maybe
        # Common case, at dict speed through the tables' fronts: engine hashes new to this key
        # (and not parents of its orphans), distinct, own hashes the masks' front does not hold
        # with this key's bit. One the table holds with it is an extra engine hash of a held
        # own hash (``st.shared``): the masks report it when they merge (``_settle_dups``).
        masks, bit = self._packed_masks, st.bit
        front = masks.front
        try:
            held = e2o.holds_any(engine_hashes)
        except OverflowError:
            stats.bad_tokens += 1
            return
        if (held or core.total + n > core.max_blocks or bit >> 64
                or (st.orphan_parents and not st.orphan_parents.keys().isdisjoint(engine_hashes))
                or len(set(owns)) != n
                or (not front.keys().isdisjoint(owns)
                    and any(map(_and, map(front.get, owns, _zeros(n)), itertools.repeat(bit))))):
            self._store_each(st, engine_hashes, owns, parent_engine_hash)
            return
        if not e2o.add_new(engine_hashes,
                           chain_entries(owns, engine_hashes, parent_engine_hash)):
            self._store_each(st, engine_hashes, owns, parent_engine_hash)  # a repeated hash
            return
        if parent_engine_hash is not None:
            e2o.add_children(parent_engine_hash, 1)
        masks.add_bit(bit, owns)
        core.total += n
        stats.stored_blocks += n

    def _clear(self, key: WorkerKey) -> None:
        st = self._state.get(key)
        if st is None:
            return
        if st.delta:
            return self._deltas.clear(st)
        e2o = cast(E2OTable, st.e2o)
        self._packed_masks.drop_bit(set(e2o.owns().tolist()), st.bit)
        self._core.total -= len(e2o)
        st.poisoned = False
        self._keys.set_orphans(st, 0)
        st.e2o = cast(dict[int, int], E2OTable(self.e2o_front_max))
        st.dups, st.shared, st.orphan_parents = {}, {}, {}

    def find_matches_for_hashes(self, own_hashes: Sequence[int]) -> dict[WorkerKey, int]:
        """Like ``find_matches`` for hashes already computed with ``router.hashing``."""
        masks = self._packed_masks
        first = masks.get(own_hashes[0], 0) if own_hashes else 0
        if not first:
            return {}
        view = cast(dict[int, int], _Getter(masks))
        if first & self._keys.dirty:  # a key holding the first block has orphans: scan exactly
            return linear_matches(view, self._bit_keys, own_hashes)
        return prefix_matches(view, self._bit_keys, own_hashes, first)

    def bytes_per_block(self) -> float:
        """Bytes of index memory per (key, engine block) entry: the tables' columns plus the
        small per-key dicts; 0.0 when empty."""
        total = self._core.total
        if not total:
            return 0.0
        size = self._packed_masks.nbytes()
        for st in self._state.values():
            size += cast(E2OTable, st.e2o).nbytes()
            size += sum(map(sys.getsizeof, (st.dups, st.shared, st.orphan_parents)))
        return size / total
