"""Vectorized linear probing shared by ``router._u64map`` and ``router._e2o``.

Each round looks at one slot per pending key (one gather) and moves the unresolved keys to their
next slot, so a round costs a fixed handful of numpy calls over the keys still pending, and the
pending set shrinks fast at the tables' fill (at most 3/4). One slot per round measured 3-5x
cheaper per key than gathering a window of slots per key (docs/benchmarks.md, round 28).

Tables mark their slots in one of two ways: by sentinel keys (``state`` None: key 0 empty,
key 1 deleted, real keys >= 2) or by a ``state`` byte per slot (0 empty, 1 live, 2 deleted).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["find", "home", "place"]

_THIRTY_TWO = np.uint64(32)
U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]


def home(keys: U64, mask: int) -> I64:
    """Home slots: ``(key ^ key >> 32) & mask``, as the scalar probes compute them."""
    return ((keys ^ (keys >> _THIRTY_TWO)) & np.uint64(mask)).astype(np.int64)


def find(kv: U64, keys: U64, mask: int, state: U8 | None) -> I64:
    """Slot of each of ``keys`` in the table, -1 where absent (sentinel tables: keys >= 2)."""
    out = np.full(len(keys), -1, dtype=np.int64)
    pending = np.arange(len(keys))
    slot = home(keys, mask)
    want = keys
    while pending.size:
        k = kv[slot]
        hit = k == want
        if state is None:
            stop = hit | (k == 0)
        else:
            s = state[slot]
            hit &= s == 1
            stop = hit | (s == 0)
        out[pending[hit]] = slot[hit]
        go = ~stop
        pending, want, slot = pending[go], want[go], (slot[go] + 1) & mask
    return out


def place(kv: U64, keys: U64, mask: int, state: U8 | None) -> tuple[I64, int]:
    """Claim a slot for each of ``keys`` (distinct, none in the table, room made): the first
    free one of its probe sequence. Writes the keys (and their live state).

    Keys that reach the same free slot in a round all write it; the one whose write stayed (read
    back) has it, the others go on probing.

    Returns:
        Each key's slot, and how many of them were deleted slots (reused).
    """
    out = np.empty(len(keys), dtype=np.int64)
    pending = np.arange(len(keys))
    slot = home(keys, mask)
    want = keys
    reused = 0
    while pending.size:
        free = np.flatnonzero(kv[slot] <= 1 if state is None else state[slot] != 1)
        go = np.ones(pending.size, dtype=np.bool_)
        if free.size:
            fs, fk = slot[free], want[free]
            was = kv[fs] if state is None else state[fs]
            kv[fs] = fk
            won = kv[fs] == fk
            taken = fs[won]
            if state is None:
                reused += int(np.count_nonzero(was[won] == 1))
            else:
                reused += int(np.count_nonzero(was[won] == 2))
                state[taken] = 1
            winners = free[won]
            out[pending[winners]] = taken
            go[winners] = False
        pending, want, slot = pending[go], want[go], (slot[go] + 1) & mask
    return out, reused
