"""Own-hash deltas into the KV index: the store path of keys whose publisher keeps the books.

A worker that declares ``KvHashScheme.form == "deltas"`` publishes, per rank, only the own hashes
that entered (``OwnStored``: first reference, parents first) or left (``OwnRemoved``: last
reference) its cache, with ``holes`` (held hashes whose parent it does not hold). Such a "delta
key" keeps no per-block container: its state is its bit in the index's ``_masks``, ``count``
(own hashes held) and the publisher's ``holes`` (in ``KeyState.orphans``, which sets the key's
dirty bit, so lookups scan it exactly while it has holes). A 64-block store of blocks no key
holds yet is one C-level pass of ``dict.setdefault``: into ``_masks`` itself for dicts, into the
masks' front (``router._masks``, merged into the uint64 table in bulk) in the packed layout.

Ignored and counted: a stored hash the key already holds (``stats.duplicate_stores``: a
publisher bug) and a removed hash it does not hold (``stats.unknown_removed``). Capacity: stores
past ``max_blocks`` are refused or, with ``evict_oldest``, make room first (``router._evict``);
a delta key's blocks are evicted oldest first: in ``_masks`` insertion order for dicts, and in
the key's ``order`` log in the packed layout, whose tables keep no order (8 bytes per stored
block, compacted as removals leave it stale, kept only by an index that evicts). Either way the
key then lacks blocks its publisher counts as held, so its ``holes`` no longer describe it: it is
marked ``poisoned`` (exact linear lookups) until its next clear. Clearing a delta key scans
``_masks`` for its bit (rare: ``AllBlocksCleared``, a dump, a worker leaving).

A key switches form with a clear: a delta event on a key holding token-path blocks clears it
first, and the token path clears a delta key before its first store.
"""

from __future__ import annotations

import array
import collections
import itertools
import operator
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, cast

from dynamo_zmq.llm import AllBlocksCleared, OwnBatch, OwnStored

from ._keystate import MASK64, KeyState
from ._masks import MaskMap
from .matching import WorkerKey

if TYPE_CHECKING:
    from .indexer import KvIndexer

__all__ = ["apply_own_batch", "clear_delta", "evict_delta"]

_and = operator.and_
_consume: Callable[[Iterable[int]], None] = collections.deque[int](maxlen=0).extend


def apply_own_batch(index: KvIndexer, key: WorkerKey, batch: OwnBatch) -> None:
    """Apply one decoded ``OwnBatch`` of ``key`` to ``index`` (see the module docstring)."""
    st = index._state.get(key) or index._add_key(key)
    if not st.delta:
        index._clear(key)  # token-path blocks of this key (none, normally)
        st.delta = True
    masks = index._masks
    for ev in batch.events:
        if isinstance(ev, AllBlocksCleared):
            index.clear(key)
            st.delta = True
            continue
        owns = ev.own_hashes
        if type(ev) is OwnStored:
            n = len(owns)
            if type(masks) is dict and index._total + n <= index.max_blocks:
                added = _set_bits(masks, st.bit, owns)  # the common case, inline
                st.count += added
                index._total += added
                index._stats.stored_blocks += added
                if added != n:
                    index._stats.duplicate_stores += n - added
            elif n:
                _store(index, key, st, owns)
        elif owns:
            _remove(index, st, owns)
        if ev.holes != st.orphans or st.poisoned:
            index._set_orphans(st, ev.holes)


def _store(index: KvIndexer, key: WorkerKey, st: KeyState, owns: list[int]) -> None:
    n = len(owns)
    masks, bit, stats = index._masks, st.bit, index._stats
    if type(masks) is not dict:
        packed = cast(MaskMap, masks)
        if index._total + n <= index.max_blocks and not bit >> 64:
            return _store_front(index, st, packed, owns)
        packed.merge()  # exact counts before the cap's arithmetic
    if index._total + n > index.max_blocks:  # only what is new needs room
        new = [h for h in dict.fromkeys(owns) if not masks.get(h, 0) & bit]
        stats.duplicate_stores += n - len(new)
        owns = _make_room(index, key, st, new)
        n = len(owns)
        if not n:
            return
    if type(masks) is dict:
        added = _set_bits(masks, bit, owns)
    else:
        added = _store_each(masks, bit, owns, _order_of(st) if index.evict_oldest else None)
        if len(st.order or ()) > 2 * (st.count + added) + 1024:  # mostly removed since: compact
            st.order = array.array("Q", [h for h in _order_of(st) if masks.get(h, 0) & bit])
    st.count += added
    index._total += added
    stats.stored_blocks += added
    stats.duplicate_stores += n - added


def _store_front(index: KvIndexer, st: KeyState, masks: MaskMap, owns: list[int]) -> None:
    """The packed layout's common case: the bits go to the masks' front (``router._masks``),
    the hashes to the key's store log; held blocks the front cannot see are corrected by
    ``PackedKvIndexer._settle_dups`` when it meets them."""
    n = len(owns)
    added = masks.add_bit(st.bit, owns)
    st.count += added
    index._total += added
    index._stats.stored_blocks += added
    index._stats.duplicate_stores += n - added
    if index.evict_oldest:  # only eviction reads the log
        order = _order_of(st)
        try:
            order.extend(owns)
        except OverflowError:  # a signed hash (a publisher's bug) is held but never evicted
            order.extend([h for h in owns if 0 <= h <= MASK64])
        if len(order) > 2 * st.count + 1024:  # mostly removed since: compact
            bit = st.bit
            st.order = array.array("Q", [h for h in order if masks.get(h, 0) & bit])


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


def _order_of(st: KeyState) -> array.array[int]:
    if st.order is None:
        st.order = array.array("Q")
    return st.order


def _make_room(index: KvIndexer, key: WorkerKey, st: KeyState, owns: list[int]) -> list[int]:
    """The part of ``owns`` that fits under the cap (after evicting, with ``evict_oldest``)."""
    from ._evict import evict_oldest

    if index.evict_oldest:
        evict_oldest(index, key, index._total + len(owns) - index.max_blocks, None, ())
    room = max(0, index.max_blocks - index._total)
    if room < len(owns):
        index._refuse(len(owns) - room)
        st.poisoned = True  # parents first: the refused tail's children may come later
        owns = owns[:room]
    return owns


def _remove(index: KvIndexer, st: KeyState, owns: list[int]) -> int:
    masks, bit, stats = index._masks, st.bit, index._stats
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
    index._total -= removed
    stats.removed_blocks += removed
    return removed


def _held(index: KvIndexer, bit: int) -> Iterable[int]:
    """The own hashes whose mask has ``bit``, in ``_masks`` order (insertion order for dicts)."""
    masks = index._masks
    if type(masks) is dict:
        return itertools.compress(masks, map(_and, masks.values(), itertools.repeat(bit)))
    packed = cast(MaskMap, masks)
    packed.merge()
    return itertools.chain((k for k, m in packed.table.items() if m & bit),
                           [k for k, m in packed.wide.items() if m & bit])


def clear_delta(index: KvIndexer, st: KeyState) -> None:
    """Forget every block of the delta key ``st`` (a scan of ``_masks``); it leaves delta form."""
    if st.count:
        masks, bit = index._masks, st.bit
        for oh in list(_held(index, bit)):
            m = masks[oh]
            if m == bit:
                del masks[oh]
            else:
                masks[oh] = m ^ bit
        index._total -= st.count
    st.count = 0
    st.order = None
    st.delta = st.poisoned = False
    index._set_orphans(st, 0)


def evict_delta(index: KvIndexer, st: KeyState, want: int) -> int:
    """Evict up to ``want`` of the delta key ``st``'s oldest blocks (counted as removed; the
    caller moves them to ``evicted``). The key is poisoned: its publisher's ``holes`` no longer
    describe it."""
    if type(index._masks) is dict:
        victims = list(itertools.islice(_held(index, st.bit), want))
    else:  # the packed tables keep no order: the key's log does
        masks, bit, order = index._masks, st.bit, _order_of(st)
        victims, i = [], 0
        seen: set[int] = set()  # (a hash stored, removed and stored again is logged twice)
        while len(victims) < want and i < len(order):
            h = order[i]
            if h not in seen and masks.get(h, 0) & bit:
                seen.add(h)
                victims.append(h)
            i += 1
        del order[:i]
    if victims:
        _remove(index, st, victims)
        st.poisoned = True
        index._set_orphans(st, st.orphans)
    return len(victims)
