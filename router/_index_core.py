"""The state every part of the KV index works on, in one object its indexer creates and hands to
its helpers (the delta store, eviction, the batch store): the masks, the keys, the counters and
the cap. ``KvIndexer`` owns it; the helpers never see the indexer itself.
"""

from __future__ import annotations

import logging

from ._index_stats import IndexerStats
from ._keystate import KeyTable

__all__ = ["IndexCore"]

log = logging.getLogger("router.indexer")


class IndexCore:
    """The KV index's shared state (see the module docstring).

    Attributes:
        masks: own hash -> bitmask of the keys holding it (a ``MaskMap`` in the packed layout).
        keys: each key's ``KeyState``, its bit, and the dirty bits (``KeyTable``).
        stats: what the index counted.
        total: (key, engine block) entries held, what ``max_blocks`` bounds.
        max_blocks: the cap on ``total`` (fixed).
        evict_oldest: stores past the cap evict the oldest blocks instead of being refused.
    """

    __slots__ = ("evict_oldest", "keys", "masks", "max_blocks", "stats", "total", "warned_full")

    def __init__(self, max_blocks: int, evict_oldest: bool) -> None:
        self.masks: dict[int, int] = {}
        self.keys = KeyTable()
        self.stats = IndexerStats()
        self.total = 0
        self.max_blocks = max_blocks
        self.evict_oldest = evict_oldest
        self.warned_full = False

    def refuse(self, n: int) -> None:
        """Count ``n`` stores refused for want of room; the first refusal logs a warning."""
        self.stats.refused += n
        if not self.warned_full:
            self.warned_full = True
            log.warning("KV index full (%d blocks); refusing new stores", self.max_blocks)
