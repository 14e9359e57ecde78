"""Own-hash deltas into the KV index: the store path of keys whose publisher keeps the books.

A worker that declares ``KvHashScheme.form == "deltas"`` publishes, per rank, only the own hashes
that entered (``OwnStored``: first reference, parents first) or left (``OwnRemoved``: last
reference) its cache, with ``holes`` (held hashes whose parent it does not hold). Such a "delta
key" keeps no per-block container: its state is its bit in the index's masks, ``count``
(own hashes held) and the publisher's ``holes`` (in ``KeyState.orphans``, which sets the key's
dirty bit, so lookups scan it exactly while it has holes). A 64-block store of blocks no key
holds yet is one C-level pass of ``dict.setdefault``: into the masks themselves for dicts, into the
masks' front (``router._masks``, merged into the uint64 table in bulk) in the packed layout.

Ignored and counted: a stored hash the key already holds (``stats.duplicate_stores``: a
publisher bug) and a removed hash it does not hold (``stats.unknown_removed``). Capacity: stores
past ``max_blocks`` are refused or, with ``evict_oldest``, make room first (``router._evict``);
a delta key's blocks are evicted oldest first: in the masks' insertion order for dicts, and in
the key's ``order`` log in the packed layout, whose tables keep no order (8 bytes per stored
block, compacted as removals leave it stale, kept only by an index that evicts). Either way the
key then lacks blocks its publisher counts as held, so its ``holes`` no longer describe it: it is
marked ``poisoned`` (exact linear lookups) until its next clear. Clearing a delta key scans
the masks for its bit (rare: ``AllBlocksCleared``, a dump, a worker leaving).

A key switches form with a clear: a delta event on a key holding token-path blocks clears it
first, and the token path clears a delta key before its first store.

``DeltaStore`` is created by the indexer, which hands it the ``IndexCore`` it works on and the
three steps it takes from the token path: adding a key, clearing one, making room. ``held``,
``remove`` and ``order_of`` are also eviction's (``router._evict``) way into delta keys.
"""

from __future__ import annotations

import array
import collections
import itertools
import operator
from collections.abc import Callable, Collection, Iterable
from typing import cast

from dynamo_zmq.llm import AllBlocksCleared, OwnBatch, OwnStored

from ._index_core import IndexCore
from ._keystate import MASK64, KeyState
from ._masks import MaskMap
from .matching import WorkerKey

__all__ = ["DeltaStore", "Evict", "held", "order_of", "remove"]

_and = operator.and_
_consume: Callable[[Iterable[int]], None] = collections.deque[int](maxlen=0).extend

#: Evicts at least ``need`` blocks for ``key`` (``router._evict.Evictor.evict``'s signature).
Evict = Callable[[WorkerKey, int, int | None, Collection[int]], int]


class DeltaStore:
    """Applies delta keys' batches to ``core`` (see the module docstring).

    Args:
        core: the index's shared state.
        add_key: the index's way to add a key (its layout's containers).
        clear_key: the index's clear of a key (token-path blocks; a delta key comes back here).
        evict: makes room under the cap (with ``core.evict_oldest``).
    """

    def __init__(self, core: IndexCore, add_key: Callable[[WorkerKey], KeyState],
                 clear_key: Callable[[WorkerKey], None], evict: Evict) -> None:
        self._core = core
        self._add_key = add_key
        self._clear_key = clear_key
        self._evict = evict

    def apply(self, key: WorkerKey, batch: OwnBatch) -> None:
        """Apply one decoded ``OwnBatch`` of ``key`` (see the module docstring)."""
        core = self._core
        keys = core.keys
        st = keys.states.get(key) or self._add_key(key)
        if not st.delta:
            self._clear_key(key)  # token-path blocks of this key (none, normally)
            st.delta = True
        masks = core.masks
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                core.stats.clears += 1  # the index's clear of a delta key
                self.clear(st)
                st.delta = True
                continue
            owns = ev.own_hashes
            if type(ev) is OwnStored:
                n = len(owns)
                if type(masks) is dict and core.total + n <= core.max_blocks:
                    added = _set_bits(masks, st.bit, owns)  # the common case, inline
                    st.count += added
                    core.total += added
                    core.stats.stored_blocks += added
                    if added != n:
                        core.stats.duplicate_stores += n - added
                elif n:
                    self._store(key, st, owns)
            elif owns:
                remove(core, st, owns)
            if ev.holes != st.orphans or st.poisoned:
                keys.set_orphans(st, ev.holes)

    def _store(self, key: WorkerKey, st: KeyState, owns: list[int]) -> None:
        core = self._core
        n = len(owns)
        masks, bit, stats = core.masks, st.bit, core.stats
        if type(masks) is not dict:
            packed = cast(MaskMap, masks)
            if core.total + n <= core.max_blocks and not bit >> 64:
                return self._store_front(st, packed, owns)
            packed.merge()  # exact counts before the cap's arithmetic
        if core.total + n > core.max_blocks:  # only what is new needs room
            new = [h for h in dict.fromkeys(owns) if not masks.get(h, 0) & bit]
            stats.duplicate_stores += n - len(new)
            owns = self._make_room(key, st, new)
            n = len(owns)
            if not n:
                return
        if type(masks) is dict:
            added = _set_bits(masks, bit, owns)
        else:
            added = _store_each(masks, bit, owns, order_of(st) if core.evict_oldest else None)
            if len(st.order or ()) > 2 * (st.count + added) + 1024:  # mostly removed: compact
                st.order = array.array("Q", [h for h in order_of(st) if masks.get(h, 0) & bit])
        st.count += added
        core.total += added
        stats.stored_blocks += added
        stats.duplicate_stores += n - added

    def _store_front(self, st: KeyState, masks: MaskMap, owns: list[int]) -> None:
        """The packed layout's common case: the bits go to the masks' front (``router._masks``),
        the hashes to the key's store log; held blocks the front cannot see are corrected by
        ``PackedKvIndexer._settle_dups`` when it meets them."""
        core = self._core
        n = len(owns)
        added = masks.add_bit(st.bit, owns)
        st.count += added
        core.total += added
        core.stats.stored_blocks += added
        core.stats.duplicate_stores += n - added
        if core.evict_oldest:  # only eviction reads the log
            order = order_of(st)
            try:
                order.extend(owns)
            except OverflowError:  # a signed hash (a publisher's bug) is held but never evicted
                order.extend([h for h in owns if 0 <= h <= MASK64])
            if len(order) > 2 * st.count + 1024:  # mostly removed since: compact
                bit = st.bit
                st.order = array.array("Q", [h for h in order if masks.get(h, 0) & bit])

    def _make_room(self, key: WorkerKey, st: KeyState, owns: list[int]) -> list[int]:
        """The part of ``owns`` that fits under the cap (after evicting, with ``evict_oldest``)."""
        core = self._core
        if core.evict_oldest:
            self._evict(key, core.total + len(owns) - core.max_blocks, None, ())
        room = max(0, core.max_blocks - core.total)
        if room < len(owns):
            core.refuse(len(owns) - room)
            st.poisoned = True  # parents first: the refused tail's children may come later
            owns = owns[:room]
        return owns

    def clear(self, st: KeyState) -> None:
        """Forget every block of the delta key ``st`` (a scan of the masks); it leaves delta
        form."""
        core = self._core
        if st.count:
            masks, bit = core.masks, st.bit
            for oh in list(held(masks, bit)):
                m = masks[oh]
                if m == bit:
                    del masks[oh]
                else:
                    masks[oh] = m ^ bit
            core.total -= st.count
        st.count = 0
        st.order = None
        st.delta = st.poisoned = False
        core.keys.set_orphans(st, 0)


def _set_bits(masks: dict[int, int], bit: int, owns: list[int]) -> int:
    """Set ``bit`` in the masks of ``owns``; returns how many did not have it. Blocks new to the
    index (the common case) are inserted in C by ``setdefault``, which leaves the masks of held
    ones as they were; only when some were held does a Python pass add the bit to those."""
    size = len(masks)
    _consume(map(masks.setdefault, owns, itertools.repeat(bit, len(owns))))
    added = len(masks) - size
    if added != len(owns):
        for oh in owns:
            m = masks[oh]
            if not m & bit:
                masks[oh] = m | bit
                added += 1
    return added


def _store_each(masks: dict[int, int], bit: int, owns: Iterable[int],
                order: array.array[int] | None) -> int:
    added = 0
    for oh in owns:
        m = masks.get(oh, 0)
        if not m & bit:
            masks[oh] = m | bit
            if order is not None and 0 <= oh <= MASK64:
                order.append(oh)
            added += 1
    return added


def order_of(st: KeyState) -> array.array[int]:
    """The store log of the delta key ``st`` (packed layout), created empty when it has none."""
    if st.order is None:
        st.order = array.array("Q")
    return st.order


def remove(core: IndexCore, st: KeyState, owns: list[int]) -> int:
    """Take the delta key ``st``'s bit out of the masks of ``owns`` (counted as removed; one it
    does not hold is ``stats.unknown_removed``); returns how many it held."""
    masks, bit, stats = core.masks, st.bit, core.stats
    removed = 0
    for oh in owns:
        m = masks.get(oh, 0)
        if not m & bit:
            stats.unknown_removed += 1
            continue
        removed += 1
        if m == bit:
            del masks[oh]
        else:
            masks[oh] = m ^ bit
    st.count -= removed
    core.total -= removed
    stats.removed_blocks += removed
    return removed


def held(masks: dict[int, int], bit: int) -> Iterable[int]:
    """The own hashes whose mask has ``bit``, in the masks' order (insertion order for dicts)."""
    if type(masks) is dict:
        return itertools.compress(masks, map(_and, masks.values(), itertools.repeat(bit)))
    packed = cast(MaskMap, masks)
    packed.merge()
    return itertools.chain((k for k, m in packed.table.items() if m & bit),
                           [k for k, m in packed.wide.items() if m & bit])
