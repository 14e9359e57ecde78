"""The KV index's own hash -> key bitmask map, packed: a ``U64Map`` plus a dict for wide masks.

Masks of keys in bit positions 0-63 (64 keys; the index hands out the lowest free bit) live in
the packed ``U64Map`` (16 B a slot instead of ~90 B per dict entry with its two int objects).
A mask with a bit at 64 or above moves to ``wide``, a plain dict, and back when it narrows, so
the index stays exact with any number of keys and pays the dict price only past 64 of them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import numpy as np

from ._u64map import U64, U64Map

__all__ = ["MaskMap", "as_u64"]

MASK64 = (1 << 64) - 1


class MaskMap:
    """Own hash -> bitmask of the keys holding it; a mask is never stored as 0."""

    __slots__ = ("table", "wide")

    def __init__(self) -> None:
        self.table = U64Map()
        self.wide: dict[int, int] = {}  # masks >= 2**64

    def __len__(self) -> int:
        return len(self.table) + len(self.wide)

    def __bool__(self) -> bool:
        return bool(self.table) or bool(self.wide)

    def get(self, own: int, default: int = 0) -> int:
        """The mask of ``own``, else ``default``."""
        if self.wide:
            m = self.wide.get(own)
            if m is not None:
                return m
        return self.table.get(own, default)

    def __getitem__(self, own: int) -> int:
        m = self.get(own, -1)
        if m == -1:
            raise KeyError(own)
        return m

    def getter(self) -> Callable[[int, int], int]:
        """The fastest ``get`` for now: the table's own while no mask is wide."""
        return self.get if self.wide else self.table.get

    def __setitem__(self, own: int, mask: int) -> None:
        if mask >> 64:
            self.wide[own] = mask
            self.table.pop(own)
        else:
            self.table.set(own, mask)
            if self.wide:
                self.wide.pop(own, None)

    def __delitem__(self, own: int) -> None:
        if not self.wide or self.wide.pop(own, None) is None:
            self.table.pop(own)

    def narrow(self, bit: int) -> bool:
        """Whether the vectorized methods apply: no wide mask and ``bit`` below 2**64."""
        return not self.wide and bit >> 64 == 0

    def get_many(self, owns: U64) -> U64:
        """Masks of ``owns`` (0 where absent); only while ``narrow``."""
        return self.table.get_many(owns)[0]

    def put_many(self, owns: U64, masks: U64) -> None:
        """Set the masks of ``owns`` (distinct), deleting those that are 0; only while
        ``narrow``."""
        zero = masks == 0
        if zero.any():
            self.table.delete_many(owns[zero])
            owns, masks = owns[~zero], masks[~zero]
        self.table.put_many(owns, masks)

    def drop_bit(self, owns: Collection[int], bit: int) -> None:
        """Take ``bit`` out of the masks of ``owns`` (distinct; absent ones are skipped)."""
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
        """Bytes held: the table's columns, plus the wide dict at ~120 B an entry."""
        return self.table.nbytes() + 120 * len(self.wide)


def as_u64(values: list[int]) -> U64:
    """``values`` (ints in [0, 2**64)) as a uint64 array."""
    return np.array(values, dtype=np.uint64)
