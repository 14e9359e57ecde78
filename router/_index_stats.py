"""What the KV index counts and what it costs: ``IndexerStats`` and the memory accounting.

``IndexerStats`` counts what ``KvIndexer`` applied, ignored or refused (the indexer's docstring
says when each counter moves). ``bytes_per_block`` computes the index's live memory per
(key, engine block) entry from its containers: dict tables plus the int objects they hold;
scripts/bench_indexer.py checks it against tracemalloc.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterable

import msgspec

from ._keystate import KeyState

__all__ = ["IndexerStats", "bytes_per_block"]

#: pymalloc sizes of a uint64 int object (3 x 30-bit digits) and of a 128-bit one (5 digits).
_INT_BYTES = 40
_PACKED_BYTES = 48


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


def bytes_per_block(masks: dict[int, int], states: Iterable[KeyState], total: int) -> float:
    """Bytes of index memory per (key, engine block) entry, computed from the live containers.

    Counts dict tables (``sys.getsizeof``, slack included) plus the int objects they own: own
    hash keys, engine hash keys, packed ``e2o`` values, and masks too wide for CPython's cached
    small ints (sampled).

    Args:
        masks: the index's own hash -> key bitmask table.
        states: every key's state.
        total: the (key, engine block) entries held.

    Returns:
        The bytes per entry; 0.0 when ``total`` is 0.
    """
    if not total:
        return 0.0
    size = sys.getsizeof(masks) + len(masks) * _INT_BYTES
    sample = list(itertools.islice(masks.values(), 0, None, max(1, len(masks) // 10_000)))
    if sample:
        # Single-bit masks are mostly the key's own bit object, shared (see apply_stored).
        wide = sum(1 for m in sample if m > 256 and m & (m - 1)) / len(sample)
        size += int(wide * len(masks)) * _INT_BYTES
    for st in states:
        size += sum(map(sys.getsizeof, (st.e2o, st.dups, st.shared, st.orphan_parents)))
        size += len(st.e2o) * (_INT_BYTES + _PACKED_BYTES)  # engine hash keys, packed values
    return size / total
