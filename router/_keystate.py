"""What the KV index knows per key: one ``KeyState`` per ``(worker_id, dp_rank)``, and its bit.

``KeyTable`` gives each key one bit of the index's masks (the lowest free position, so masks
stay small ints) and maps the bit back to the key. A key's state chains the blocks it holds by
*engine* hash, so that each store finds its parent and each removal knows what it drops:

* ``e2o`` maps each held engine hash to one packed int: its own hash (bits 0-63, ``MASK64``),
  its parent's engine hash (64-127), a has-parent bit (``HAS_PARENT``, 128) and its number of
  held children (in ``CHILD`` units, bits ``CHILD_SHIFT`` = 129 and up).
* ``dups`` counts extra stores of an engine hash already held (vLLM does publish the same hash
  twice); ``shared`` counts extra engine hashes mapping to an own hash the key already holds
  (an engine-side salt the router cannot see). The key's bit leaves the index's mask of an own
  hash with its last reference to it.
* ``orphans`` counts the key's held blocks whose parent engine block is not held (it was
  removed first), ``orphan_parents`` their missing parents, as ``(held children, own hash)``;
  ``unlink`` and ``relink`` keep both exact when a block is removed and when a missing parent is
  stored again. Orphans are counted per engine block, which over-counts only in odd cases (twin
  engine hashes), never under-counts.
* ``poisoned``: an engine hash was stored again, under its held children, with other content;
  the bookkeeping is no longer trusted until the key's next clear.
* ``delta``: the key is fed own-hash deltas (``router._delta_store``): it keeps no per-block
  container at all, only its bit in the masks, ``count`` (own hashes held), its publisher's
  ``holes`` in ``orphans``, and ``poisoned`` once the index itself dropped some of its blocks.
"""

from __future__ import annotations

import array
import itertools
import operator
from collections.abc import Iterator

from .matching import WorkerKey

__all__ = [
    "CHILD",
    "CHILD_SHIFT",
    "HAS_PARENT",
    "MASK64",
    "KeyState",
    "KeyTable",
    "chain_entries",
    "relink",
    "unlink",
]

MASK64 = (1 << 64) - 1
HAS_PARENT = 1 << 128
CHILD_SHIFT = 129
CHILD = 1 << CHILD_SHIFT
_SIXTY_FOUR = itertools.repeat(64)
_or, _lshift = operator.or_, operator.lshift


def chain_entries(owns: list[int], engine_hashes: list[int], parent: int | None) -> Iterator[int]:
    """The packed ``e2o`` entries of a chain of new blocks stored in one event: each block's own
    hash, its parent (the block before it, else ``parent``), and one held child but the last.
    Built in C (``map``), for the stores' common path."""
    flags = [HAS_PARENT | CHILD] * len(owns)
    flags[-1] = HAS_PARENT
    if parent is None:
        flags[0] ^= HAS_PARENT
    parents = itertools.chain((parent or 0,), engine_hashes)
    return map(_or, map(_or, owns, map(_lshift, parents, _SIXTY_FOUR)), flags)


class KeyState:
    """The blocks one key holds (see the module docstring); ``bit`` is its bit in the masks."""

    __slots__ = ("bit", "count", "delta", "dups", "e2o", "order", "orphan_parents", "orphans",
                 "poisoned", "shared")

    def __init__(self, bit: int) -> None:
        self.bit = bit
        self.e2o: dict[int, int] = {}  # engine hash -> packed (see the module docstring)
        self.dups: dict[int, int] = {}  # engine hash -> extra stores
        self.shared: dict[int, int] = {}  # own hash -> extra engine hashes mapping to it
        self.orphan_parents: dict[int, tuple[int, int]] = {}  # gone parent -> (children, own)
        self.orphans = 0  # held blocks whose parent engine block is not held
        self.poisoned = False  # bookkeeping no longer trusted: always scan linearly
        self.delta = False  # fed own-hash deltas: no e2o, see the module docstring
        self.count = 0  # own hashes held (delta keys only)
        #: Delta keys in the packed layout: own hashes in store order (``router._delta_store``).
        self.order: array.array[int] | None = None


class KeyTable:
    """The index's keys: each key's ``KeyState``, for each bit in use its key, and ``dirty``, the
    bits of the keys with orphans (or poisoned), which lookups scan exactly."""

    __slots__ = ("_free_bits", "_next_bit", "bit_keys", "dirty", "states")

    def __init__(self) -> None:
        self.states: dict[WorkerKey, KeyState] = {}
        self.bit_keys: dict[int, WorkerKey] = {}  # bit value -> key
        self.dirty = 0
        self._free_bits: list[int] = []  # bit positions released by drop()
        self._next_bit = 0

    def add(self, key: WorkerKey) -> KeyState:
        """The state of ``key``, created with the lowest free bit when the key is new."""
        st = self.states.get(key)
        if st is None:
            if self._free_bits:
                pos = min(self._free_bits)  # small bit positions keep masks small ints
                self._free_bits.remove(pos)
            else:
                pos = self._next_bit
                self._next_bit += 1
            st = self.states[key] = KeyState(1 << pos)
            self.bit_keys[st.bit] = key
        return st

    def drop(self, key: WorkerKey) -> KeyState:
        """Forget ``key`` and free its bit for the next new key; returns its state."""
        st = self.states.pop(key)
        del self.bit_keys[st.bit]
        self._free_bits.append(st.bit.bit_length() - 1)
        return st

    def set_orphans(self, st: KeyState, orphans: int) -> None:
        """Record the orphan count of ``st``; its bit is dirty while it has orphans or is
        poisoned."""
        st.orphans = orphans
        if orphans > 0 or st.poisoned:
            self.dirty |= st.bit
        else:
            self.dirty &= ~st.bit


def unlink(st: KeyState, eh: int, packed: int, oh: int, children: int) -> int:
    """Parent/children bookkeeping of the engine block ``eh`` just removed from ``st.e2o``.

    Args:
        st: the key's state.
        eh: the removed engine hash.
        packed: its packed ``e2o`` value.
        oh: its own hash (``packed & MASK64``).
        children: its held children (``packed >> CHILD_SHIFT``).

    Returns:
        The key's orphan count after the removal (the caller records it).
    """
    orphans = st.orphans + children  # its held children lose their parent
    if children:
        st.orphan_parents[eh] = (children, oh)
    if packed & HAS_PARENT:
        pe = (packed >> 64) & MASK64
        pp = st.e2o.get(pe)
        if pp is not None:
            if pp >> CHILD_SHIFT:  # (only a poisoned key can be at 0 here)
                st.e2o[pe] = pp - CHILD
        else:  # it was an orphan itself
            orphans -= 1
            gone = st.orphan_parents.get(pe)
            if gone is not None:
                if gone[0] > 1:
                    st.orphan_parents[pe] = (gone[0] - 1, gone[1])
                else:
                    del st.orphan_parents[pe]
    return orphans


def relink(st: KeyState, eh: int, oh: int, packed: int) -> int:
    """Bookkeeping of the engine block ``eh`` stored again while its children are held.

    Its held children stop being orphans if it comes back with the content they chain from;
    with other content, the key is poisoned (its bookkeeping is no longer trusted).

    Args:
        st: the key's state; ``eh`` must be in ``st.orphan_parents``.
        eh: the stored engine hash.
        oh: its own hash.
        packed: its packed ``e2o`` value, without children.

    Returns:
        ``packed``, with the held children counted in when the content is unchanged.
        ``st.orphans`` is updated; the caller records it.
    """
    children, old_own = st.orphan_parents.pop(eh)
    if old_own == oh:
        packed += children * CHILD
        st.orphans -= children
    else:
        st.poisoned = True
    return packed
