"""The KV index: which (worker, dp_rank) holds which prefix blocks, fed by engines' KV events.

Data structure (chosen for CPython speed, see scripts/bench_indexer.py):

* Each ``WorkerKey = (worker_id, dp_rank)`` gets one bit. ``_masks`` maps the router's own block
  hash (``router.hashing``: chained, so one hash names a whole prefix) to the int bitmask of the
  keys holding that block.
* Per key, a ``KeyState`` (``router._keystate``: packed ``e2o`` entries, duplicate and orphan
  counts) chains the held blocks by engine hash. A key without orphans (held blocks whose parent
  was removed first) holds an ancestor-closed set, so along any prompt its blocks form a prefix
  and ``find_matches_for_hashes`` binary-searches each key's match length
  (``router.matching.prefix_matches``), ~10 us for a 2,000-block prompt over 8 keys. Engines
  evict leaves first (vLLM frees a request's blocks tail-first), so orphans are rare; while a key
  holding the prompt's first block has some, the query is answered by an exact linear scan
  instead (``linear_matches``).

Events are handled conservatively (never index data the event does not prove): a mismatched
block size, misaligned tokens, an unknown parent or a conflicting re-store is ignored and
counted, and stores past ``max_blocks`` are refused or, with ``evict_oldest``, evict the oldest
blocks (``router._evict``). docs/architecture.md ("The KV index's rules") lists each case.
Memory: ``bytes_per_block()`` computes the live figure (``router._index_stats``).

The indexer owns an ``IndexCore`` (``router._index_core``: the masks, the keys, the counters)
and the helpers it hands it to: a ``DeltaStore`` (``router._delta_store``) and an ``Evictor``.
"""

from __future__ import annotations

import array
import itertools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

from ._delta_store import DeltaStore
from ._evict import Evictor
from ._index_core import IndexCore
from ._index_stats import IndexerStats as IndexerStats
from ._index_stats import bytes_per_block
from ._keystate import CHILD as _CHILD
from ._keystate import CHILD_SHIFT as _CHILD_SHIFT
from ._keystate import HAS_PARENT as _HAS_PARENT
from ._keystate import MASK64 as _MASK64
from ._keystate import KeyState, KeyTable, chain_entries, relink, unlink
from .events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, OwnBatch
from .hashing import ROOT_SEED, TokenIds, block_hashes, event_own_hashes, mm_identifiers, root_hash
from .hashing import without_lora_name as without_lora_name
from .matching import WorkerKey as WorkerKey
from .matching import linear_matches, prefix_matches

__all__ = ["DEFAULT_MAX_BLOCKS", "IndexerStats", "KvIndexer", "WorkerKey"]

DEFAULT_MAX_BLOCKS = 10_000_000

_NO_EXTRA = [None]
_h64 = xxhash.xxh3_64_intdigest
_and = operator.and_
_or = operator.or_


def _zeros(n: int) -> itertools.repeat[int]:
    return itertools.repeat(0, n)


class KvIndexer:
    """Prefix-block index over (worker_id, dp_rank) keys. Not thread-safe; one owner.

    Args:
        block_size: tokens per block; events with another block size are ignored.
        max_blocks: bound on (key, engine hash) entries; stores beyond it are refused.
        evict_oldest: stores beyond ``max_blocks`` evict the oldest blocks instead of being
            refused (see ``router._evict``).
    """

    def __init__(self, block_size: int, max_blocks: int = DEFAULT_MAX_BLOCKS, *,
                 evict_oldest: bool = False) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        self.block_size = block_size
        self._core = core = IndexCore(max_blocks, evict_oldest)
        # The core's containers (never rebound), read directly on the hot paths.
        self._stats = core.stats
        self._masks = core.masks
        self._keys: KeyTable = core.keys
        self._state: dict[WorkerKey, KeyState] = self._keys.states
        self._bit_keys: dict[int, WorkerKey] = self._keys.bit_keys
        self._evictor = Evictor(core, self.apply_removed)
        self._deltas = DeltaStore(core, self._add_key, self._clear, self._evictor.evict)
        #: Called with an own hash before a removal reads its ``shared`` count (a layout that
        #: counts twins late settles it: ``PackedKvIndexer``).
        self._settle_own: Callable[[int], None] | None = None

    @property
    def max_blocks(self) -> int:
        """The bound on (key, engine hash) entries (fixed at construction)."""
        return self._core.max_blocks

    @property
    def evict_oldest(self) -> bool:
        """Whether stores past ``max_blocks`` evict the oldest blocks (fixed at construction)."""
        return self._core.evict_oldest

    @property
    def stats(self) -> IndexerStats:
        """What the index counted (stores, removals, what it ignored and why), exact as of now."""
        return self._stats

    # --- keys ------------------------------------------------------------------------------------

    def keys(self) -> set[WorkerKey]:
        """Keys seen in events (an ``AllBlocksCleared`` keeps its key; ``remove_worker`` drops
        it)."""
        return set(self._state)

    def num_blocks(self, key: WorkerKey | None = None) -> int:
        """Distinct engine blocks held by ``key``, or the sum over all keys (what ``max_blocks``
        bounds). Duplicate stores of one engine hash count once."""
        if key is None:
            return self._core.total
        st = self._state.get(key)
        return 0 if st is None else len(st.e2o) + st.count

    def num_unique_blocks(self) -> int:
        """Distinct own hashes (prefixes) held by at least one key."""
        return len(self._masks)

    # --- events ----------------------------------------------------------------------------------

    def apply_batch(self, worker_id: int, batch: EventBatch | OwnBatch) -> None:
        """Apply one decoded batch from ``worker_id`` (``dp_rank`` None means rank 0); an
        ``OwnBatch`` (own-hash deltas) goes to ``router._delta_store``."""
        key = (worker_id, batch.dp_rank or 0)
        if type(batch) is OwnBatch:
            return self._deltas.apply(key, batch)
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                lora = ev.lora_name if ev.lora_name is not None else ev.lora_id
                # vLLM repeats the adapter's name, and pairs each image's hash with an offset.
                extra = mm_identifiers(without_lora_name(ev.extra_keys, ev.lora_name))
                self.apply_stored(key, ev.block_hashes, ev.parent_block_hash, ev.token_ids,
                                  ev.block_size, lora=lora, extra_keys=extra,
                                  own_hashes=ev.own_hashes)
            elif isinstance(ev, BlockRemoved):
                self.apply_removed(key, ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.clear(key)

    def apply_stored(self, key: WorkerKey, engine_hashes: list[int],
                     parent_engine_hash: int | None, token_ids: Sequence[int], block_size: int,
                     *, lora: int | str | None = None,
                     extra_keys: list[Any] | None = None,
                     own_hashes: list[int] | None = None) -> None:
        """Index full blocks stored by ``key`` (engine hashes are normalized uint64 ints).

        Args:
            key: (worker_id, dp_rank).
            engine_hashes: the engine's hashes of the stored blocks, in chain order.
            parent_engine_hash: engine hash of the block before the first, ``None`` for a root.
            token_ids: all stored blocks' tokens, concatenated (ints in [0, 2**32)).
            block_size: the event's block size.
            lora: LoRA adapter name or id, ``None`` for the base model.
            extra_keys: per block, the engine's extra hash inputs or ``None``.
            own_hashes: per block, the router's hash from an edge-hashing worker; tokens unread.
        """
        stats, core = self._stats, self._core
        st = self._state.get(key) or self._keys.add(key)
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
        e2o = st.e2o
        if parent_engine_hash is None:
            seed = ROOT_SEED if lora is None else root_hash(lora)
        else:
            packed = e2o.get(parent_engine_hash)
            if packed is None:
                stats.unknown_parent += 1
                return
            seed = packed & _MASK64
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
                    e2o[eh] = oh
                else:
                    e2o[eh] = oh | parent_engine_hash << 64 | _HAS_PARENT
                    e2o[parent_engine_hash] += _CHILD
                core.total += 1
                stats.stored_blocks += 1
                masks, bit = self._masks, st.bit
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
        # Common case, mostly in C: engine hashes new to this key (and not parents of its
        # orphans), own hashes it does not hold yet.
        masks, bit = self._masks, st.bit
        if (core.total + n > core.max_blocks or not e2o.keys().isdisjoint(engine_hashes)
                or (st.orphan_parents and not st.orphan_parents.keys().isdisjoint(engine_hashes))):
            self._store_each(st, engine_hashes, owns, parent_engine_hash)
            return
        # Blocks no key holds yet (one probe each, stopping at the first held one) skip the
        # per-block mask lookups.
        held = None if masks.keys().isdisjoint(owns) else list(map(masks.get, owns, _zeros(n)))
        if held is not None and any(map(_and, held, itertools.repeat(bit, n))):
            self._store_each(st, engine_hashes, owns, parent_engine_hash)
            return
        size = len(e2o)
        e2o.update(zip(engine_hashes, chain_entries(owns, engine_hashes, parent_engine_hash),
                       strict=False))
        if len(e2o) != size + n:  # an engine hash repeated within the event: undo, go slow
            for eh in engine_hashes:
                e2o.pop(eh, None)
            self._store_each(st, engine_hashes, owns, parent_engine_hash)
            return
        if parent_engine_hash is not None:
            e2o[parent_engine_hash] += _CHILD
        if held is None:  # blocks new to the index (the common case) share the key's bit object
            masks.update(zip(owns, itertools.repeat(bit, n), strict=True))
        else:
            masks.update(zip(owns, map(_or, held, itertools.repeat(bit, n)), strict=True))
        core.total += n
        stats.stored_blocks += n

    def _store_each(self, st: KeyState, engine_hashes: list[int], owns: list[int],
                    parent: int | None) -> None:
        """Block-by-block store: duplicates, conflicts, re-stored parents, the capacity bound."""
        stats, e2o, masks, bit, core = self._stats, st.e2o, self._masks, st.bit, self._core
        room = core.max_blocks - core.total
        added = 0
        for eh, oh in zip(engine_hashes, owns, strict=True):
            prev, parent = parent, eh
            old = e2o.get(eh)
            if old is not None:
                st.dups[eh] = st.dups.get(eh, 0) + 1
                stats.duplicate_stores += 1
                if old & _MASK64 != oh:
                    stats.conflicts += 1
                    break  # the rest chains from content this key does not hold
                continue
            if added >= room:
                core.refuse(1)
                continue
            added += 1
            if prev is None:
                packed = oh
            else:
                packed = oh | prev << 64 | _HAS_PARENT
                e2o[prev] += _CHILD
            if st.orphan_parents and eh in st.orphan_parents:  # stored again under its children
                packed = relink(st, eh, oh, packed)
                self._keys.set_orphans(st, st.orphans)
            e2o[eh] = packed
            m = masks.get(oh, 0)
            if m & bit:
                st.shared[oh] = st.shared.get(oh, 0) + 1
            else:
                masks[oh] = m | bit if m else bit
        core.total += added
        stats.stored_blocks += added

    def apply_removed(self, key: WorkerKey, engine_hashes: list[int]) -> None:
        """Drop one reference per engine hash; a block leaves the key with its last reference."""
        st = self._state.get(key)
        stats = self._stats
        if st is None:
            stats.unknown_removed += len(engine_hashes)
            return
        e2o, dups, shared, masks, bit = st.e2o, st.dups, st.shared, self._masks, st.bit
        removed, settle = 0, self._settle_own
        for eh in engine_hashes:
            d = dups.get(eh)
            if d is not None:
                if d > 1:
                    dups[eh] = d - 1
                else:
                    del dups[eh]
                continue
            packed = e2o.pop(eh, None)
            if packed is None:
                stats.unknown_removed += 1
                continue
            removed += 1
            oh = packed & _MASK64
            children = packed >> _CHILD_SHIFT
            if children or packed & _HAS_PARENT:
                self._keys.set_orphans(st, unlink(st, eh, packed, oh, children))
            if settle is not None:
                settle(oh)
            s = shared.get(oh)
            if s is not None:
                if s > 1:
                    shared[oh] = s - 1
                else:
                    del shared[oh]
                continue
            m = masks[oh] & ~bit
            if m:
                masks[oh] = m
            else:
                del masks[oh]
        self._core.total -= removed
        stats.removed_blocks += removed

    def clear(self, key: WorkerKey) -> None:
        """Forget every block of ``key`` (its ``AllBlocksCleared``); the key stays known."""
        self._stats.clears += 1
        self._clear(key)

    def _clear(self, key: WorkerKey) -> None:
        st = self._state.get(key)
        if st is None:
            return
        if st.delta:
            return self._deltas.clear(st)
        masks, keep = self._masks, ~st.bit
        for oh in {packed & _MASK64 for packed in st.e2o.values()}:
            m = masks.get(oh)
            if m is None:
                continue
            m &= keep
            if m:
                masks[oh] = m
            else:
                del masks[oh]
        self._core.total -= len(st.e2o)
        st.poisoned = False
        self._keys.set_orphans(st, 0)
        st.e2o, st.dups, st.shared, st.orphan_parents = {}, {}, {}, {}

    def _add_key(self, key: WorkerKey) -> KeyState:
        return self._keys.add(key)

    def remove_worker(self, worker_id: int) -> None:
        """Forget ``worker_id`` entirely: all its DP ranks, their blocks and their keys."""
        for key in [k for k in self._state if k[0] == worker_id]:
            self._clear(key)
            self._keys.drop(key)

    # --- queries ---------------------------------------------------------------------------------

    def find_matches(self, token_ids: TokenIds, *, lora: int | str | None = None
                     ) -> dict[WorkerKey, int]:
        """Leading full blocks of the prompt held by each key (only keys with >= 1 block)."""
        if not self._masks:
            return {}
        seed = None if lora is None else root_hash(lora)
        return self.find_matches_for_hashes(block_hashes(token_ids, self.block_size, seed))

    def find_matches_for_hashes(self, own_hashes: Sequence[int]) -> dict[WorkerKey, int]:
        """Like ``find_matches`` for hashes already computed with ``router.hashing``."""
        first = self._masks.get(own_hashes[0], 0) if own_hashes else 0
        if not first:
            return {}
        if first & self._keys.dirty:  # a key holding the first block has orphans: scan exactly
            return linear_matches(self._masks, self._bit_keys, own_hashes)
        return prefix_matches(self._masks, self._bit_keys, own_hashes, first)

    # --- memory ----------------------------------------------------------------------------------

    def bytes_per_block(self) -> float:
        """Bytes of index memory per (key, engine block) entry, computed from the live containers
        (``router._index_stats.bytes_per_block``); 0.0 when empty. scripts/bench_indexer.py
        checks it against tracemalloc."""
        return bytes_per_block(self._masks, self._state.values(), self._core.total)
