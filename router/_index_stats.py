"""What the KV index counts and what it costs: ``IndexerStats`` and the memory accounting.

``IndexerStats`` counts what ``KvIndexer`` applied, ignored or refused (the indexer's docstring
says when each counter moves). ``bytes_per_block`` computes the index's live memory per
(key, engine block) entry from its containers: the packed bitmask table, dict tables plus the
int objects they hold;
scripts/bench_indexer.py checks it against tracemalloc.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import msgspec

from ._keystate import KeyState
from ._masks import MaskMap

__all__ = ["IndexerStats", "bytes_per_block"]



class IndexerStats(msgspec.Struct, gc=False):
    """Counters of what the indexer applied, ignored or refused (all monotonic)."""

    stored_blocks: int = 0
    removed_blocks: int = 0
    duplicate_stores: int = 0
    conflicts: int = 0
    unknown_parent: int = 0
    bad_length: int = 0
    block_size_mismatch: int = 0
    unknown_removed: int = 0
    refused: int = 0
    evicted: int = 0
    bad_tokens: int = 0
    clears: int = 0


def bytes_per_block(masks: MaskMap, states: Iterable[KeyState], total: int) -> float:
    """Bytes of index memory per (key, engine block) entry, computed from the live containers.

    Counts the packed bitmask table's columns (``MaskMap.nbytes``) and, per key, dict tables
    (``sys.getsizeof``, slack included) plus the int objects they own: engine hash keys and
    packed ``e2o`` values.

    Args:
        masks: the index's own hash -> key bitmask map.
        states: every key's state.
        total: the (key, engine block) entries held.

    Returns:
        The bytes per entry; 0.0 when ``total`` is 0.
    """
    if not total:
        return 0.0
    size = masks.nbytes()
    for st in states:
        size += st.e2o.nbytes() + sum(map(sys.getsizeof, (st.dups, st.shared, st.orphan_parents)))
    return size / total
