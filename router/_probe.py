"""Vectorized linear probing shared by ``router._u64map`` and ``router._e2o``.

Each round looks at a window of ``WINDOW`` consecutive slots per key (one gather), so a key
whose probe sequence is up to ``WINDOW`` slots long is resolved in one round; a round costs a
fixed handful of numpy calls, so the rounds, not the keys, set the price of a batch.

Tables mark their slots in one of two ways: by sentinel keys (``state`` None: key 0 empty,
key 1 deleted, real keys >= 2) or by a ``state`` byte per slot (0 empty, 1 live, 2 deleted).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["WINDOW", "find", "home", "place"]

WINDOW = 8
_AR = np.arange(WINDOW, dtype=np.int64)
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
    start = home(keys, mask)
    while pending.size:
        win = (start[:, None] + _AR) & mask
        hit = kv[win] == keys[pending, None]
        if state is None:
            empty = kv[win] == 0
        else:
            s = state[win]
            hit &= s == 1
            empty = s == 0
        stop = hit | empty
        first = stop.argmax(1)
        rows = np.arange(pending.size)
        found = hit[rows, first]
        out[pending[found]] = win[rows, first][found]
        go = ~stop[rows, first]
        pending, start = pending[go], (start[go] + WINDOW) & mask
    return out


def place(kv: U64, keys: U64, mask: int, state: U8 | None) -> tuple[I64, int]:
    """Claim a slot for each of ``keys`` (distinct, none in the table, room made): the first
    free one of its probe sequence. Writes the keys (and their live state).

    Returns:
        Each key's slot, and how many of them were deleted slots (reused).
    """
    out = np.empty(len(keys), dtype=np.int64)
    pending = np.arange(len(keys))
    start = home(keys, mask)
    reused = 0
    while pending.size:
        win = (start[:, None] + _AR) & mask
        free = kv[win] <= 1 if state is None else state[win] != 1
        first = free.argmax(1)
        rows = np.arange(pending.size)
        anyf = free[rows, first]
        slot = win[rows, first]
        cand = np.flatnonzero(anyf)
        keep = np.ones(pending.size, dtype=np.bool_)
        if cand.size:
            # One winner per free slot (the first key claiming it); losers look again.
            taken, firsts = np.unique(slot[cand], return_index=True)
            winners = cand[firsts]
            if state is None:
                reused += int(np.count_nonzero(kv[taken] == 1))
            else:
                reused += int(np.count_nonzero(state[taken] == 2))
                state[taken] = 1
            kv[taken] = keys[pending[winners]]
            out[pending[winners]] = taken
            keep[winners] = False
        start = np.where(anyf, start, (start + WINDOW) & mask)[keep]
        pending = pending[keep]
    return out, reused
