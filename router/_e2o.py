"""A key's engine hash -> block entry table, packed: open addressing over ``array`` columns.

It replaces a ``dict[int, int]`` of packed ints (``router._keystate``: own hash in bits 0-63,
parent engine hash in 64-127, ``HAS_PARENT`` at 128, held children from 129) that cost ~140 B
per entry (two int objects and the dict's share). Here a slot is 33 B: the engine hash, the own
hash, the parent engine hash and a meta word (has-parent bit, 31 bits of children, 32 bits of
insertion order) in ``array('Q')`` columns, and a state byte (empty, live, deleted).

The scalar API is the dict's, in the same packed ints (``get``, ``in``, ``[]``, ``pop``,
iteration in insertion order, ``items``), so the index's bookkeeping (``router._keystate``,
``router._evict``) reads as before; ``find_many`` and ``insert_many`` take numpy ``uint64``
arrays and probe or insert a whole event's blocks in a few numpy calls through zero-copy views
of the columns. Probing is linear from the key's home slot (as in ``router._u64map``); the
table doubles when live plus deleted slots pass 4/5 (live ones then fill at most half of it,
and a bulk insert at most 2/3) and is rebuilt at its size when deleted slots made it full.

New entries go first to ``front``, a plain dict of the same packed ints (the dict layout's
entry), so a store pays a dict's C-level insert; ``merge`` moves the front into the columns in
a few numpy calls once it holds ``front_max`` entries, or before a vectorized call reads the
columns. A hash is in the front or in the columns, never both; the front's entries are newer
than the columns' (insertion order: the columns', then the front's).
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Iterable, Iterator
from typing import Literal

import numpy as np
import numpy.typing as npt

from ._probe import any_held, find, place
from ._u64map import U64

__all__ = ["FRONT_MAX", "E2OTable"]

_MASK64 = (1 << 64) - 1
_EMPTY, _LIVE, _DEAD = 0, 1, 2
_MIN_BITS = 3
_CHILDREN = (1 << 31) - 1
_SEQ_LIMIT = 1 << 32
_MASK192 = (1 << 192) - 1
_24 = itertools.repeat(24)
_LITTLE: itertools.repeat[Literal["little"]] = itertools.repeat("little")
#: Entries a table's front holds before it is merged (~150 B each until then).
FRONT_MAX = 2048
I64 = npt.NDArray[np.int64]


def _zeros(code: str, n: int) -> array[int]:
    return array(code, bytes((8 if code == "Q" else 1) * n))


class E2OTable:
    """Engine hash -> packed entry (see the module docstring)."""

    __slots__ = ("_bits", "_filled", "_keys", "_live", "_mask", "_meta", "_own", "_parent",
                 "_seq", "_state", "_vk", "_vm", "_vo", "_vp", "_vs", "front", "front_max")

    def __init__(self, front_max: int = FRONT_MAX) -> None:
        self._seq = 0  # next insertion order
        self.front: dict[int, int] = {}  # engine hash -> packed entry, not in the columns yet
        self.front_max = front_max
        self._alloc(_MIN_BITS)

    def _alloc(self, bits: int) -> None:
        n = 1 << bits
        self._bits, self._mask = bits, n - 1
        self._keys, self._own = _zeros("Q", n), _zeros("Q", n)
        self._parent, self._meta = _zeros("Q", n), _zeros("Q", n)
        self._state = _zeros("B", n)
        self._vk: U64 = np.frombuffer(self._keys, dtype=np.uint64)
        self._vo: U64 = np.frombuffer(self._own, dtype=np.uint64)
        self._vp: U64 = np.frombuffer(self._parent, dtype=np.uint64)
        self._vm: U64 = np.frombuffer(self._meta, dtype=np.uint64)
        self._vs = np.frombuffer(self._state, dtype=np.uint8)
        self._live = 0
        self._filled = 0  # live + deleted slots

    def __len__(self) -> int:
        return self._live + len(self.front)

    def nbytes(self) -> int:
        """Bytes held by the columns (the front merged into them first)."""
        self.merge()
        return 33 * (self._mask + 1)

    # --- scalar (the dict's API, packed ints) ----------------------------------------------------

    def _slot(self, eh: int) -> int:
        keys, state, mask = self._keys, self._state, self._mask
        i = (eh ^ eh >> 32) & mask
        while True:
            s = state[i]
            if s == _EMPTY:
                return -1
            if keys[i] == eh and s == _LIVE:
                return i
            i = (i + 1) & mask

    def _packed(self, i: int) -> int:
        m = self._meta[i]
        return (self._own[i] | self._parent[i] << 64 | (m & 1) << 128
                | ((m >> 1) & _CHILDREN) << 129)

    def get(self, eh: int, default: int | None = None) -> int | None:
        """The packed entry of ``eh``, else ``default``."""
        p = self.front.get(eh)
        if p is not None:
            return p
        i = self._slot(eh)
        return default if i < 0 else self._packed(i)

    def own(self, eh: int) -> int:
        """The own hash of ``eh``, -1 when not held."""
        p = self.front.get(eh)
        if p is not None:
            return p & _MASK64
        i = self._slot(eh)
        return -1 if i < 0 else self._own[i]

    def __contains__(self, eh: object) -> bool:
        return eh in self.front or (isinstance(eh, int) and self._slot(eh) >= 0)

    def __getitem__(self, eh: int) -> int:
        p = self.get(eh)
        if p is None:
            raise KeyError(eh)
        return p

    def __setitem__(self, eh: int, packed: int) -> None:
        children = packed >> 129
        if children > _CHILDREN:
            raise OverflowError(f"{children} children")
        front = self.front
        if eh in front:
            front[eh] = packed
            return
        i = self._slot(eh)
        if i >= 0:  # update: keeps its insertion order
            self._own[i] = packed & _MASK64
            self._parent[i] = (packed >> 64) & _MASK64
            low = (packed >> 128) & 1 | children << 1
            self._meta[i] = self._meta[i] & ~0xFFFFFFFF & _MASK64 | low
            return
        front[eh] = packed
        if len(front) >= self.front_max:
            self.merge()

    def add_children(self, eh: int, n: int) -> None:
        """Count ``n`` more held children (negative: fewer) of the held ``eh``."""
        p = self.front.get(eh)
        if p is not None:
            self.front[eh] = p + (n << 129)
            return
        i = self._slot(eh)
        if i < 0:
            raise KeyError(eh)
        self._meta[i] += n << 1

    def pop(self, eh: int, default: int | None = None) -> int | None:
        """Remove ``eh``; its packed entry, else ``default``."""
        p = self.front.pop(eh, None)
        if p is not None:
            return p
        i = self._slot(eh)
        if i < 0:
            return default
        self._state[i] = _DEAD
        self._live -= 1
        return self._packed(i)

    def holds_any(self, ehs: list[int]) -> bool:
        """Whether any of ``ehs`` is held: the front's C-level check, then one vectorized probe
        of the columns (``OverflowError`` for a hash outside uint64)."""
        if not self.front.keys().isdisjoint(ehs):
            return True
        if not self._live:
            return False
        return any_held(self._vk, np.array(ehs, dtype=np.uint64), self._mask, self._vs)

    def put_new(self, eh: int, packed: int) -> None:
        """Store ``eh``, not held (the caller checked), through the front."""
        front = self.front
        front[eh] = packed
        if len(front) >= self.front_max:
            self.merge()

    def add_new(self, ehs: list[int], packed: Iterable[int]) -> bool:
        """Store the entries ``zip(ehs, packed)``, none of ``ehs`` held (``holds_any``), in
        order, through the front. False, and nothing stored, if ``ehs`` repeats a hash."""
        front = self.front
        size = len(front)
        front.update(zip(ehs, packed, strict=False))
        if len(front) != size + len(ehs):
            for eh in ehs:
                front.pop(eh, None)
            return False
        if len(front) >= self.front_max:
            self.merge()
        return True

    def _order(self) -> I64:
        live = np.flatnonzero(self._vs == _LIVE)
        return live[np.argsort(self._vm[live] >> np.uint64(32), kind="stable")]

    def __iter__(self) -> Iterator[int]:
        """Held engine hashes, oldest first."""
        return itertools.chain(self._vk[self._order()].tolist(), list(self.front))

    def items(self) -> Iterator[tuple[int, int]]:
        """(engine hash, packed entry), oldest first."""
        return itertools.chain(((self._keys[i], self._packed(i)) for i in self._order().tolist()),
                               list(self.front.items()))

    def values(self) -> Iterator[int]:
        """Packed entries, oldest first."""
        return itertools.chain((self._packed(i) for i in self._order().tolist()),
                               list(self.front.values()))

    def owns(self) -> U64:
        """The own hashes of the held blocks (one per block, repeats kept)."""
        self.merge()
        out: U64 = self._vo[self._vs == _LIVE]
        return out

    # --- vectorized ------------------------------------------------------------------------------

    def merge(self) -> None:
        """Move the front into the columns, in its order, after theirs."""
        front = self.front
        if not front:
            return
        keys = np.fromiter(front.keys(), np.uint64, len(front))
        # A packed entry as 24 little-endian bytes is its three words: own hash, parent, and
        # the meta low word (has-parent bit | children << 1) as it is.
        try:
            raw = b"".join(map(int.to_bytes, front.values(), _24, _LITTLE))
        except OverflowError:  # a negative entry (a caller's signed own hash): its low bits
            raw = b"".join([(p & _MASK192).to_bytes(24, "little") for p in front.values()])
        words = np.frombuffer(raw, dtype=np.uint64).reshape(-1, 3)
        front.clear()
        self._insert(keys, words[:, 0], words[:, 1], words[:, 2])

    def find_many(self, keys: U64) -> I64:
        """Slot of each of ``keys``, -1 where not held."""
        self.merge()
        return find(self._vk, keys, self._mask, self._vs)

    def insert_many(self, keys: U64, own: U64, parent: U64, low: U64) -> None:
        """Insert ``keys`` (distinct, none held), in that order, with their own hashes, parent
        engine hashes and meta low words (has-parent bit | children << 1)."""
        self.merge()
        self._insert(keys, own, parent, low)

    def _insert(self, keys: U64, own: U64, parent: U64, low: U64) -> None:
        n = len(keys)
        if self._seq + n >= _SEQ_LIMIT or (self._filled + n) * 5 > (self._mask + 1) * 4:
            self._rehash(n)
        seq = np.arange(self._seq, self._seq + n, dtype=np.uint64) << np.uint64(32)
        self._seq += n
        self._place(keys, own, parent, low | seq)

    def _place(self, keys: U64, own: U64, parent: U64, meta: U64) -> None:
        slots, reused = place(self._vk, keys, self._mask, self._vs)
        self._vo[slots], self._vp[slots], self._vm[slots] = own, parent, meta
        self._live += slots.size
        self._filled += slots.size - reused

    def _rehash(self, extra: int) -> None:
        """Rebuild for ``extra`` more keys (doubling while live ones would pass 1/2, or with the
        extra ones 2/3), renumbering the insertion order from 0."""
        order = self._order()
        keys, own = self._vk[order].copy(), self._vo[order].copy()
        parent = self._vp[order].copy()
        low = self._vm[order] & np.uint64(0xFFFFFFFF)
        bits = max(_MIN_BITS, self._bits)
        while 1 << bits < keys.size * 2 or (1 << bits) * 2 < (keys.size + extra) * 3:
            bits += 1
        self._alloc(bits)
        self._seq = keys.size
        if keys.size:
            seq = np.arange(keys.size, dtype=np.uint64) << np.uint64(32)
            self._place(keys, own, parent, low | seq)
