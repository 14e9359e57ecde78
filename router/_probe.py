"""Vectorized linear probing shared by ``router._u64map`` and ``router._e2o``.

A round costs a fixed handful of numpy calls over the keys still pending, so both the rounds
and the keys set a batch's price. While many keys are pending, a round looks at one slot per
key (one gather; most keys stop at their home slot or the next); once few are left (``SMALL``),
a round looks at a window of ``WINDOW`` consecutive slots per key, so the long probe sequences
of a full table take a few rounds, not one per slot. (The windows alone cost 3-5x more per key
in a bulk merge; one slot alone cost a 64-block store ~20 rounds.)

Tables mark their slots in one of two ways: by sentinel keys (``state`` None: key 0 empty,
key 1 deleted, real keys >= 2) or by a ``state`` byte per slot (0 empty, 1 live, 2 deleted).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["SMALL", "WINDOW", "any_held", "find", "home", "place"]

WINDOW = 8
SMALL = 256  # pending keys at or below which a round probes windows
_AR = np.arange(WINDOW, dtype=np.int64)
#: ``any_held``'s windows: the first for every key, then wider ones for the few keys whose
#: run of occupied slots went on (runs are long in a table near its fill limit).
_FIRST, _THEN = np.arange(16, dtype=np.int64), np.arange(128, dtype=np.int64)
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
    while pending.size > SMALL:  # one slot per key
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
    while pending.size:  # a window per key
        win = (slot[:, None] + _AR) & mask
        hit = kv[win] == want[:, None]
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
        pending, want, slot = pending[go], want[go], (slot[go] + WINDOW) & mask
    return out


def any_held(kv: U64, keys: U64, mask: int, state: U8 | None) -> bool:
    """Whether any of ``keys`` is in the table (sentinel tables: keys >= 2): as
    ``(find(...) >= 0).any()``, in fewer calls.

    A key held is in the run of occupied slots from its home, so a window of slots answers for
    a key once it holds the key or an empty slot; only keys whose window is all occupied look
    further (rarely, at the tables' fill)."""
    slot = home(keys, mask)
    want = keys[:, None]
    ar = _FIRST
    while slot.size:
        win = (slot[:, None] + ar) & mask
        k = kv[win]
        if state is None:
            if (k == want).any():
                return True
            more = (k != 0).all(1)
        else:
            s = state[win]
            if ((k == want) & (s == 1)).any():
                return True
            more = (s != 0).all(1)
        slot, want = slot[more] + ar.size, want[more]
        ar = _THEN
    return False


def place(kv: U64, keys: U64, mask: int, state: U8 | None) -> tuple[I64, int]:
    """Claim a slot for each of ``keys`` (distinct, none in the table, room made): the first
    free one of its probe sequence. Writes the keys (and their live state).

    One slot per key: keys that reach the same free slot all write it, and the one whose write
    reads back has it. Windows: one winner per free slot, the first key claiming it. The losers
    go on probing.

    Returns:
        Each key's slot, and how many of them were deleted slots (reused).
    """
    out = np.empty(len(keys), dtype=np.int64)
    pending = np.arange(len(keys))
    slot = home(keys, mask)
    want = keys
    reused = 0
    while pending.size > SMALL:
        free = np.flatnonzero(_free(kv, state, slot))
        go = np.ones(pending.size, dtype=np.bool_)
        if free.size:
            fs, fk = slot[free], want[free]
            was = _marks(kv, state, fs)
            kv[fs] = fk
            won = kv[fs] == fk
            taken = fs[won]
            reused += _deleted(was[won], state)
            if state is not None:
                state[taken] = 1
            winners = free[won]
            out[pending[winners]] = taken
            go[winners] = False
        pending, want, slot = pending[go], want[go], (slot[go] + 1) & mask
    while pending.size:
        win = (slot[:, None] + _AR) & mask
        free_w = _free(kv, state, win)
        first = free_w.argmax(1)
        rows = np.arange(pending.size)
        anyf = free_w[rows, first]
        at = win[rows, first]
        cand = np.flatnonzero(anyf)
        keep = np.ones(pending.size, dtype=np.bool_)
        if cand.size:
            taken, firsts = np.unique(at[cand], return_index=True)
            winners = cand[firsts]
            reused += _deleted(_marks(kv, state, taken), state)
            if state is not None:
                state[taken] = 1
            kv[taken] = want[winners]
            out[pending[winners]] = taken
            keep[winners] = False
        slot = np.where(anyf, slot, (slot + WINDOW) & mask)[keep]
        pending, want = pending[keep], want[keep]
    return out, reused


def _marks(kv: U64, state: U8 | None, slots: npt.NDArray[np.int64]) -> npt.NDArray[np.generic]:
    """What marks ``slots`` empty, live or deleted: their keys (sentinels) or state bytes."""
    return kv[slots] if state is None else state[slots]


def _free(kv: U64, state: U8 | None, slots: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
    """Whether ``slots`` are empty or deleted."""
    return kv[slots] <= 1 if state is None else state[slots] != 1


def _deleted(marks: npt.NDArray[np.generic], state: U8 | None) -> int:
    """How many of ``marks`` (``_marks``) are deleted slots."""
    return int(np.count_nonzero(marks == (1 if state is None else 2)))
