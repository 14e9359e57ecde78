"""The KV index's own hash -> key bitmask map, packed: a ``U64Map`` plus a dict for wide masks.

Masks of keys in bit positions 0-63 (64 keys; the index hands out the lowest free bit) live in
the packed ``U64Map`` (16 B a slot instead of ~90 B per dict entry with its two int objects).
A mask with a bit at 64 or above moves to ``wide``, a plain dict, and back when it narrows, so
the index stays exact with any number of keys and pays the dict price only past 64 of them.

Bulk stores of single bits (the own-hash deltas of ``router._delta_store``) go first to
``front``, a plain dict of the bits stored since the last merge, filled by one C-level
``dict.setdefault`` pass per store; ``merge`` moves it into the table in a few numpy calls once
it holds ``FRONT_MAX`` hashes (or before anything reads the table in bulk), so the table's
per-key cost is paid vectorized. A hash's mask is its ``front`` bits OR its table (or wide) mask.
A bit in both is a store the front counted as new of a block the key already held: ``merge``
and the scalar writes find it and report it to ``on_dup``, which the index uses to correct its
counts (``PackedKvIndexer._settle_dups``). ``settle`` reports a hash's duplicates at once.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Collection, Iterable

import numpy as np

from ._u64map import U64, U64Map

__all__ = ["FRONT_MAX", "MaskMap", "as_u64"]

MASK64 = (1 << 64) - 1
#: Hashes the front holds before a store merges it (~6 MB of dict and ints at the most).
FRONT_MAX = 1 << 16
_consume: Callable[[Iterable[int]], None] = collections.deque[int](maxlen=0).extend


class MaskMap:
    """Own hash -> bitmask of the keys holding it; a mask is never stored as 0."""

    __slots__ = ("front", "front_max", "on_dup", "table", "wide")

    def __init__(self) -> None:
        self.table = U64Map()
        self.wide: dict[int, int] = {}  # masks >= 2**64
        self.front: dict[int, int] = {}  # own hash -> bits (< 2**64) stored since the merge
        self.front_max = FRONT_MAX
        #: Told a hash and its bits found both in ``front`` and in the table (duplicates).
        self.on_dup: Callable[[int, int], None] | None = None

    def __len__(self) -> int:
        self.merge()
        return len(self.table) + len(self.wide)

    def __bool__(self) -> bool:
        return bool(self.front) or bool(self.table) or bool(self.wide)

    def get(self, own: int, default: int = 0) -> int:
        """The mask of ``own``, else ``default``."""
        f = self.front.get(own, 0) if self.front else 0
        if self.wide:
            m = self.wide.get(own)
            if m is not None:
                return m | f
        m = self.table.get(own, 0) | f
        return m if m else default

    def __getitem__(self, own: int) -> int:
        m = self.get(own, -1)
        if m == -1:
            raise KeyError(own)
        return m

    def getter(self) -> Callable[[int, int], int]:
        """The fastest ``get`` for now: the table's own while no mask is wide and the front is
        empty."""
        return self.get if self.wide or self.front else self.table.get

    def add_bit(self, bit: int, owns: list[int]) -> int:
        """Set ``bit`` (< 2**64) in the masks of ``owns``, through the front; returns how many
        the front did not hold with it (a bit the table holds too is reported to ``on_dup`` at
        the merge). Merges once the front holds ``front_max`` hashes (``FRONT_MAX``)."""
        front = self.front
        size = len(front)
        _consume(map(front.setdefault, owns, itertools.repeat(bit, len(owns))))
        added = len(front) - size
        if added != len(owns):  # some were in the front already (with other bits, or this one)
            for oh in owns:
                m = front[oh]
                if not m & bit:
                    front[oh] = m | bit
                    added += 1
        if len(front) >= self.front_max:
            self.merge()
        return added

    def add_one(self, bit: int, own: int) -> bool:
        """``add_bit`` for one hash: False if the front held it with ``bit`` already."""
        front = self.front
        f = front.get(own)
        if f is None:
            front[own] = bit
        elif f & bit:
            return False
        else:
            front[own] = f | bit
        if len(front) >= self.front_max:
            self.merge()
        return True

    def merge(self) -> None:
        """Move the front into the table (and wide masks), reporting duplicates to ``on_dup``."""
        front = self.front
        if not front:
            return
        dups: list[tuple[int, int]] = []
        wide = self.wide
        if wide:
            for own in [o for o in front if o in wide]:
                f = front.pop(own)
                w = wide[own]
                if f & w:
                    dups.append((own, f & w))
                wide[own] = w | f
        try:
            keys = np.fromiter(front.keys(), np.uint64, len(front))
        except OverflowError:  # a publisher's bug (a signed hash): such keys go one by one
            for own in [o for o in front if not 0 <= o <= MASK64]:
                f = front.pop(own)
                m = self.table.get(own, 0)
                if f & m:
                    dups.append((own, f & m))
                self.table.set(own, m | f)
            keys = np.fromiter(front.keys(), np.uint64, len(front))
        n = len(front)
        bits = np.fromiter(front.values(), np.uint64, n)
        front.clear()
        both = self.table.or_many(keys, bits) & bits
        nz = np.flatnonzero(both)
        dups += zip(keys[nz].tolist(), both[nz].tolist(), strict=True)
        if dups and self.on_dup is not None:
            for own, d in dups:
                self.on_dup(own, d)

    def _settle(self, own: int) -> None:
        """Take ``own`` out of the front before a scalar write, reporting its duplicates."""
        f = self.front.pop(own, 0)
        if f:
            w = self.wide.get(own) if self.wide else None
            d = f & (self.table.get(own, 0) if w is None else w)
            if d and self.on_dup is not None:
                self.on_dup(own, d)

    def settle(self, own: int) -> None:
        """Move ``own``'s front bits into the table now, reporting its duplicates (``on_dup``),
        so that the index's counts for it are exact before it reads them."""
        if self.front and own in self.front:
            self[own] = self.get(own)

    def __setitem__(self, own: int, mask: int) -> None:
        if self.front:
            self._settle(own)
        if mask >> 64:
            self.wide[own] = mask
            self.table.pop(own)
        else:
            self.table.set(own, mask)
            if self.wide:
                self.wide.pop(own, None)

    def __delitem__(self, own: int) -> None:
        if self.front:
            self._settle(own)
        if not self.wide or self.wide.pop(own, None) is None:
            self.table.pop(own)

    def narrow(self, bit: int) -> bool:
        """Whether the vectorized methods apply: no wide mask and ``bit`` below 2**64."""
        self.merge()  # (a merge can only add wide masks' bits, never make one)
        return not self.wide and bit >> 64 == 0

    def get_many(self, owns: U64) -> U64:
        """Masks of ``owns`` (0 where absent); only while ``narrow``."""
        self.merge()
        return self.table.get_many(owns)[0]

    def put_many(self, owns: U64, masks: U64) -> None:
        """Set the masks of ``owns`` (distinct), deleting those that are 0; only while
        ``narrow``."""
        self.merge()
        zero = masks == 0
        if zero.any():
            self.table.delete_many(owns[zero])
            owns, masks = owns[~zero], masks[~zero]
        self.table.put_many(owns, masks)

    def drop_bit(self, owns: Collection[int], bit: int) -> None:
        """Take ``bit`` out of the masks of ``owns`` (distinct; absent ones are skipped)."""
        self.merge()
        if self.narrow(bit):
            if owns:
                arr = as_u64(list(owns))  # absent ones read 0 and stay absent
                self.put_many(arr, self.get_many(arr) & np.uint64(MASK64 ^ bit))
            return
        for own in owns:
            m = self.get(own, -1)
            if m == -1:
                continue
            m &= ~bit
            if m:
                self[own] = m
            else:
                del self[own]

    def nbytes(self) -> int:
        """Bytes held: the table's columns, plus the wide dict at ~120 B an entry (after a
        merge: the front is bounded, ``FRONT_MAX``)."""
        self.merge()
        return self.table.nbytes() + 120 * len(self.wide)


def as_u64(values: list[int]) -> U64:
    """``values`` (ints in [0, 2**64)) as a uint64 array."""
    return np.array(values, dtype=np.uint64)
