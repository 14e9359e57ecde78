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

``Evictor`` is created by the indexer, which hands it the ``IndexCore`` and its own removal of a
key's engine blocks (the token path's bookkeeping).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection

from ._delta_store import held, order_of, remove
from ._index_core import IndexCore
from ._keystate import CHILD_SHIFT, HAS_PARENT, MASK64, KeyState
from .matching import WorkerKey

__all__ = ["Evictor"]


class Evictor:
    """Evicts the oldest blocks of ``core`` (see the module docstring).

    Args:
        core: the index's shared state.
        remove_blocks: the index's removal of a key's engine hashes (``apply_removed``).
    """

    def __init__(self, core: IndexCore,
                 remove_blocks: Callable[[WorkerKey, list[int]], None]) -> None:
        self._core = core
        self._remove_blocks = remove_blocks

    def evict(self, key: WorkerKey, need: int, parent: int | None,
              stored: Collection[int]) -> int:
        """Evict at least ``need`` blocks (fewer only when nothing else is left).

        Args:
            key: the key about to store.
            need: blocks to free.
            parent: the store's parent engine hash (of ``key``; not evicted), or None.
            stored: the store's engine hashes (not evicted from ``key``).

        Returns:
            The blocks evicted (counted in ``stats.evicted``, not in ``removed_blocks``).
        """
        core = self._core
        want = max(need, core.max_blocks // 256)
        states = core.keys.states
        protect = {*stored, parent}
        none: set[int | None] = set()
        done = 0
        for victim in sorted(states, key=lambda k: len(states[k].e2o) + states[k].count,
                             reverse=True):
            if done >= need:
                break
            vst = states[victim]
            if vst.delta:  # no parent links: oldest in the masks' order (router._delta_store)
                done += self._evict_delta(vst, want - done)
                continue
            done += self._evict_key(victim, vst, want - done,
                                    protect if victim == key else none)
        core.stats.removed_blocks -= done
        core.stats.evicted += done
        return done

    def _evict_key(self, key: WorkerKey, st: KeyState, want: int,
                   protect: set[int | None]) -> int:
        """Evict up to ``want`` of ``key``'s oldest leaf blocks; see the module docstring."""
        got = self._walk(key, st, list(itertools.islice(st.e2o, 4 * want)), want, protect)
        # A chain that straddles the windows frees only its tail in one walk (its other blocks
        # still had children then): walk all of the key's blocks again until enough are free
        # or a walk frees nothing.
        while got < want:
            more = self._walk(key, st, list(st.e2o), want - got, protect)
            if not more:
                break
            got += more
        if got == 0:  # no leaf (bookkeeping of a poisoned key): oldest first, orphans or not
            for eh in list(itertools.islice(st.e2o, want + 1)):
                if got < want and eh not in protect:
                    self._drop(key, st, [eh])
                    got += 1
        return got

    def _walk(self, key: WorkerKey, st: KeyState, hashes: list[int], want: int,
              protect: set[int | None]) -> int:
        got, e2o = 0, st.e2o
        for start in range(0, len(hashes), want):
            # Newest to oldest, counting the children this pass removes, so that one removal
            # call takes a whole chain tail first.
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
            self._drop(key, st, victims)
            got += len(victims)
            if got >= want:
                break
        return got

    def _drop(self, key: WorkerKey, st: KeyState, hashes: list[int]) -> None:
        dups = st.dups
        for eh in hashes:
            dups.pop(eh, None)  # every reference goes
        self._remove_blocks(key, hashes)

    def _evict_delta(self, st: KeyState, want: int) -> int:
        """Evict up to ``want`` of the delta key ``st``'s oldest blocks (counted as removed;
        ``evict`` moves them to ``evicted``). The key is poisoned: its publisher's ``holes`` no
        longer describe it."""
        core = self._core
        if type(core.masks) is dict:
            victims = list(itertools.islice(held(core.masks, st.bit), want))
        else:  # the packed tables keep no order: the key's log does
            masks, bit, order = core.masks, st.bit, order_of(st)
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
            remove(core, st, victims)
            st.poisoned = True
            core.keys.set_orphans(st, st.orphans)
        return len(victims)
