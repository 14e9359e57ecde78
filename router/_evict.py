"""Eviction of the oldest blocks when a capped ``KvIndexer`` (``evict_oldest``) is full.

The victims come from the key holding the most blocks (one busy worker cannot push the others
out), oldest first in insertion order, each only once it is a leaf (no held children): the
oldest window of the key's blocks is walked newest to oldest, so a chain inside it goes tail
first and the key's blocks stay ancestor-closed (no orphans: the binary-searched lookup stays
valid). A block with children newer than the window stays; the next window is tried when one
yields too little. Evicting by ``chunk`` (at least 1/256 of the cap) pays rarely for the walk
over a dict's front, where CPython skips deleted entries one by one. The parent of the store
being made room for and the blocks it stores again are never evicted, so that the store chains
and applies just as it would without the cap. A delta key (``router._delta_store``) has no parent
links: its oldest blocks in the masks' insertion order go, and it is scanned exactly from then on.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection
from typing import TYPE_CHECKING

from ._delta_store import evict_delta
from ._keystate import CHILD_SHIFT, HAS_PARENT, MASK64, KeyState
from .matching import WorkerKey

if TYPE_CHECKING:
    from .indexer import KvIndexer

__all__ = ["evict_oldest"]


def evict_oldest(index: KvIndexer, key: WorkerKey, need: int, parent: int | None,
                 stored: Collection[int]) -> int:
    """Evict at least ``need`` blocks (fewer only when nothing else is left) from ``index``.

    Args:
        index: the full index.
        key: the key about to store.
        need: blocks to free.
        parent: the store's parent engine hash (of ``key``; not evicted), or None.
        stored: the store's engine hashes (not evicted from ``key``).

    Returns:
        The blocks evicted (counted in ``index.stats.evicted``, not in ``removed_blocks``).
    """
    want = max(need, index.max_blocks // 256)
    states = index._state
    protect = {*stored, parent}
    none: set[int | None] = set()
    done = 0
    for victim in sorted(states, key=lambda k: len(states[k].e2o) + states[k].count,
                         reverse=True):
        if done >= need:
            break
        vst = states[victim]
        if vst.delta:  # no parent links: oldest in the masks' order (router._delta_store)
            done += evict_delta(index, vst, want - done)
            continue
        done += _evict_key(index, victim, vst, want - done, protect if victim == key else none)
    index._stats.removed_blocks -= done
    index._stats.evicted += done
    return done


def _evict_key(index: KvIndexer, key: WorkerKey, st: KeyState, want: int,
               protect: set[int | None]) -> int:
    """Evict up to ``want`` of ``key``'s oldest leaf blocks; see the module docstring."""
    got = _walk(index, key, st, list(itertools.islice(st.e2o, 4 * want)), want, protect)
    # A chain that straddles the windows frees only its tail in one walk (its other blocks
    # still had children then): walk all of the key's blocks again until enough are free or a
    # walk frees nothing.
    while got < want:
        more = _walk(index, key, st, list(st.e2o), want - got, protect)
        if not more:
            break
        got += more
    if got == 0:  # no leaf (bookkeeping of a poisoned key): oldest first, orphans or not
        for eh in list(itertools.islice(st.e2o, want + 1)):
            if got < want and eh not in protect:
                _drop(index, key, st, [eh])
                got += 1
    return got


def _walk(index: KvIndexer, key: WorkerKey, st: KeyState, hashes: list[int], want: int,
          protect: set[int | None]) -> int:
    got, e2o = 0, st.e2o
    for start in range(0, len(hashes), want):
        # Newest to oldest, counting the children this pass removes, so that one removal call
        # takes a whole chain tail first.
        victims: list[int] = []
        gone: dict[int, int] = {}
        for eh in reversed(hashes[start:start + want]):
            packed = e2o.get(eh)
            if (packed is None or (packed >> CHILD_SHIFT) - gone.get(eh, 0) > 0
                    or eh in protect):
                continue
            victims.append(eh)
            if packed & HAS_PARENT:
                pe = (packed >> 64) & MASK64
                gone[pe] = gone.get(pe, 0) + 1
            if got + len(victims) >= want:
                break
        _drop(index, key, st, victims)
        got += len(victims)
        if got >= want:
            break
    return got


def _drop(index: KvIndexer, key: WorkerKey, st: KeyState, hashes: list[int]) -> None:
    dups = st.dups
    for eh in hashes:
        dups.pop(eh, None)  # every reference goes
    index.apply_removed(key, hashes)
