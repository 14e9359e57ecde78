"""Many edge-hashed stores of one batch applied at once: the table work of a whole batch in a
few numpy calls, so that its per-event Python cost is a handful of list operations.

``store_batch`` applies a batch's ``BlockStored`` events together only when each would take
``PackedKvIndexer.apply_stored``'s common path on its own and none depends on another: every event
carries ``own_hashes`` (one per block) at the index's block size; each parent is already held
by the key, or stored by an earlier event of the batch, or the event is a root; the batch's
engine hashes and own hashes are all distinct, new to the key (and not parents of its orphans),
and fit under the cap. Then applying them together gives the same index, in the same insertion
order, as applying them one by one; otherwise nothing is touched and the caller applies them
one by one. It works on what ``PackedKvIndexer`` hands it: the index's ``IndexCore``, its
packed masks and the key's state.
"""

from __future__ import annotations

from typing import cast

import numpy as np

from ._e2o import E2OTable
from ._index_core import IndexCore
from ._keystate import KeyState
from ._masks import MaskMap, as_u64
from .events import BlockStored, KvEvent

__all__ = ["store_batch"]


def store_batch(core: IndexCore, masks: MaskMap, st: KeyState, block_size: int,
                events: list[KvEvent]) -> bool:
    """Apply ``events`` (all ``BlockStored``) of the key ``st`` together if allowed (module
    docstring).

    Args:
        core: the index's shared state.
        masks: the index's packed masks (``core.masks``).
        st: the state of the events' key.
        block_size: the index's block size.
        events: the batch's events.

    Returns:
        Whether they were applied; False leaves the index untouched.
    """
    if st.delta or not masks.narrow(st.bit):
        return False
    e2o, bs = cast(E2OTable, st.e2o), block_size
    ehs: list[int] = []
    owns: list[int] = []
    parents: list[int] = []
    lows: list[int] = []
    linked: list[int] = []  # parents already held
    inner: list[tuple[int, int]] = []  # (parent, first block of its event) stored in the batch
    for ev in events:
        if type(ev) is not BlockStored:
            return False
        hs, own = ev.block_hashes, ev.own_hashes
        n = len(hs)
        if own is None or len(own) != n or not n or ev.block_size != bs:
            return False
        p = ev.parent_block_hash
        low = [3] * n  # has a parent, one child
        low[-1] = 1
        if p is None:
            low[0] ^= 1
            parents.append(0)
        else:
            if e2o.own(p) >= 0:
                linked.append(p)
            else:  # it must be stored earlier in this batch
                inner.append((p, len(ehs)))
            parents.append(p)
        parents += hs[:-1]
        ehs += hs
        owns += own
        lows += low
    total = len(ehs)
    seen = set(ehs)
    if (core.total + total > core.max_blocks or len(seen) != total
            or len(set(owns)) != total or not seen.isdisjoint(linked)
            or (st.orphan_parents and not st.orphan_parents.keys().isdisjoint(seen))):
        return False
    if inner:
        where = dict(zip(ehs, range(total), strict=True))
        for p, start in inner:
            i = where.get(p, total)
            if i >= start:
                return False
            lows[i] += 2  # one more child
    try:
        ehs_np, owns_np = as_u64(ehs), as_u64(owns)
    except OverflowError:
        return False
    if (e2o.find_many(ehs_np) >= 0).any():
        return False
    bit = np.uint64(st.bit)
    held = masks.get_many(owns_np)
    if (held & bit).any():
        return False
    for p in linked:
        e2o.add_children(p, 1)
    e2o.insert_many(ehs_np, owns_np, as_u64(parents), as_u64(lows))
    masks.put_many(owns_np, held | bit)
    core.total += total
    core.stats.stored_blocks += total
    return True
