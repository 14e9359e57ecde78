"""A packed uint64 -> uint64 hash map: open addressing over two ``array('Q')`` columns.

Why: a ``dict[int, int]`` of 64-bit ints costs ~90 B per entry in CPython (two int objects and
the table's share); this map costs 16 B per slot, 22-48 B per entry at its fill (between 1/3
and 3/4 of the slots hold live keys or tombstones). Scalar ``get`` / ``set`` / ``pop`` are
plain Python over the arrays (indexing an ``array`` returns a Python int cheaply); the ``*_many``
methods take numpy ``uint64`` arrays and probe all keys at once through zero-copy numpy views
of the same arrays, so a 64-block store costs a few numpy calls instead of 64 probes.

Layout: slot ``i`` holds key ``keys[i]`` and value ``vals[i]``; a key's home slot is
``(key ^ key >> 32) & (slots - 1)`` (the keys are xxh3 or engine hashes, already well mixed;
like CPython's int hash, patterned keys only cost probes), collisions probe linearly. Key
``EMPTY`` (0) marks a never-used slot and ``TOMBSTONE`` (1) a deleted one (a probe goes on past
it); the real keys 0 and 1 live in a small side dict. The table doubles when live keys plus
tombstones pass 3/4 of the slots (sized so that live keys then fill at most 1/2 of it, and a
bulk insert at most 2/3), and is rebuilt at the same size when tombstones alone fill it.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

from ._probe import find, place

__all__ = ["U64Map"]

U64 = npt.NDArray[np.uint64]

EMPTY = 0
TOMBSTONE = 1
_MASK64 = (1 << 64) - 1
_MIN_BITS = 3


def _zeros(n: int) -> array[int]:
    return array("Q", bytes(8 * n))


class U64Map:
    """uint64 -> uint64 map (see the module docstring). Values are ints in [0, 2**64)."""

    __slots__ = ("_bits", "_filled", "_keys", "_kv", "_live", "_mask", "_side",
                 "_vals", "_vv")

    def __init__(self, capacity: int = 0) -> None:
        bits = _MIN_BITS
        while (1 << bits) * 3 < capacity * 4:
            bits += 1
        self._side: dict[int, int] = {}  # the keys 0 and 1
        self._alloc(bits)

    def _alloc(self, bits: int) -> None:
        self._bits = bits
        self._mask = (1 << bits) - 1
        self._keys = _zeros(1 << bits)
        self._vals = _zeros(1 << bits)
        self._kv: U64 = np.frombuffer(self._keys, dtype=np.uint64)
        self._vv: U64 = np.frombuffer(self._vals, dtype=np.uint64)
        self._live = 0  # live keys in the table (the side dict apart)
        self._filled = 0  # live keys + tombstones

    # --- size ------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._live + len(self._side)

    def __bool__(self) -> bool:
        return bool(self._live or self._side)

    def capacity(self) -> int:
        """Slots in the table."""
        return self._mask + 1

    def nbytes(self) -> int:
        """Bytes held by the two columns (the side dict of keys 0 and 1 apart)."""
        return 16 * (self._mask + 1)

    # --- scalar ----------------------------------------------------------------------------------

    def get(self, key: int, default: int = 0) -> int:
        """The value of ``key``, else ``default``."""
        if key < 2:
            return self._side.get(key, default)
        keys = self._keys
        mask = self._mask
        i = (key ^ key >> 32) & mask
        k = keys[i]
        while k != key:
            if k == EMPTY:
                return default
            i = (i + 1) & mask
            k = keys[i]
        return self._vals[i]

    def __contains__(self, key: int) -> bool:
        return self.get(key, -1) != -1

    def set(self, key: int, value: int) -> None:
        """Map ``key`` to ``value``."""
        if key < 2:
            self._side[key] = value
            return
        keys = self._keys
        mask = self._mask
        i = (key ^ key >> 32) & mask
        free = -1
        while True:
            k = keys[i]
            if k == key:
                self._vals[i] = value
                return
            if k == EMPTY:
                break
            if k == TOMBSTONE and free < 0:
                free = i
            i = (i + 1) & mask
        if free >= 0:
            i = free
        else:
            self._filled += 1
        keys[i] = key
        self._vals[i] = value
        self._live += 1
        if self._filled * 4 > (mask + 1) * 3:
            self._rehash(0)

    def pop(self, key: int, default: int = -1) -> int:
        """Remove ``key``; its value, else ``default``."""
        if key < 2:
            return self._side.pop(key, default)
        keys = self._keys
        mask = self._mask
        i = (key ^ key >> 32) & mask
        while True:
            k = keys[i]
            if k == key:
                keys[i] = TOMBSTONE
                self._live -= 1
                return self._vals[i]
            if k == EMPTY:
                return default
            i = (i + 1) & mask

    def clear(self) -> None:
        """Remove every key and shrink to the smallest table."""
        self._side.clear()
        self._alloc(_MIN_BITS)

    def items(self) -> Iterator[tuple[int, int]]:
        """(key, value) pairs, in slot order."""
        yield from self._side.items()
        live = np.flatnonzero(self._kv > TOMBSTONE)
        yield from zip(self._kv[live].tolist(), self._vv[live].tolist(), strict=True)

    # --- vectorized ------------------------------------------------------------------------------

    def find_many(self, keys: U64) -> npt.NDArray[np.int64]:
        """Slot of each of ``keys`` (all >= 2) in the table, -1 where absent."""
        return find(self._kv, keys, self._mask, None)

    def get_many(self, keys: U64) -> tuple[U64, npt.NDArray[np.bool_]]:
        """Values of ``keys`` (0 where absent) and which were present."""
        low = keys < 2
        if low.any():  # keys 0 and 1 live in the side dict
            vals = np.zeros(len(keys), dtype=np.uint64)
            found = np.zeros(len(keys), dtype=np.bool_)
            for j in np.flatnonzero(low).tolist():
                v = self._side.get(int(keys[j]))
                if v is not None:
                    vals[j], found[j] = v, True
            hi = np.flatnonzero(~low)
            vals[hi], found[hi] = self.get_many(keys[hi])
            return vals, found
        slots = self.find_many(keys)
        found = slots >= 0
        return np.where(found, self._vv[slots], np.uint64(0)), found

    def put_many(self, keys: U64, vals: U64) -> None:
        """Map each of ``keys`` (distinct) to its value in ``vals``."""
        low = keys < 2
        if low.any():
            for k, v in zip(keys[low].tolist(), vals[low].tolist(), strict=True):
                self._side[k] = v
            keys, vals = keys[~low], vals[~low]
        slots = self.find_many(keys)
        found = slots >= 0
        self._vv[slots[found]] = vals[found]
        new = np.flatnonzero(~found)
        if new.size:
            if (self._filled + new.size) * 4 > (self._mask + 1) * 3:
                self._rehash(new.size)
            self._insert_new(keys[new], vals[new])

    def or_many(self, keys: U64, vals: U64) -> U64:
        """OR each of ``vals`` into the value of its key in ``keys`` (distinct; absent keys are
        added with it); returns the values before (0 where absent)."""
        low = keys < 2
        if low.any():
            old = np.zeros(len(keys), dtype=np.uint64)
            for j in np.flatnonzero(low).tolist():
                k, v = int(keys[j]), int(vals[j])
                old[j] = self._side.get(k, 0)
                self._side[k] = int(old[j]) | v
            hi = np.flatnonzero(~low)
            old[hi] = self.or_many(keys[hi], vals[hi])
            return old
        slots = self.find_many(keys)
        found = slots >= 0
        old = np.where(found, self._vv[slots], np.uint64(0))
        at = slots[found]
        self._vv[at] = old[found] | vals[found]
        new = np.flatnonzero(~found)
        if new.size:
            if (self._filled + new.size) * 4 > (self._mask + 1) * 3:
                self._rehash(new.size)
            self._insert_new(keys[new], vals[new])
        return old

    def delete_many(self, keys: U64) -> int:
        """Remove those of ``keys`` (distinct) present; how many were."""
        low = keys < 2
        gone = 0
        if low.any():
            for k in keys[low].tolist():
                gone += self._side.pop(k, None) is not None
            keys = keys[~low]
        slots = self.find_many(keys)
        slots = slots[slots >= 0]
        self._kv[slots] = TOMBSTONE
        self._live -= slots.size
        return gone + int(slots.size)

    def _insert_new(self, keys: U64, vals: U64) -> None:
        """Insert ``keys`` (distinct, >= 2, none present; room already made)."""
        slots, reused = place(self._kv, keys, self._mask, None)
        self._vv[slots] = vals
        self._live += slots.size
        self._filled += slots.size - reused

    def _rehash(self, extra: int) -> None:
        """Rebuild the table for ``extra`` more keys: double while live keys would pass 1/2,
        or the table with the extra ones 2/3 (a bulk insert fills it no fuller)."""
        live = np.flatnonzero(self._kv > TOMBSTONE)
        keys, vals = self._kv[live].copy(), self._vv[live].copy()
        bits = max(_MIN_BITS, self._bits)
        while 1 << bits < keys.size * 2 or (1 << bits) * 2 < (keys.size + extra) * 3:
            bits += 1
        self._alloc(bits)
        if keys.size:
            self._insert_new(keys, vals)
