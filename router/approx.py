"""Approximate KV index for engines that publish no KV events (Dynamo's ``--no-kv-events``).

The router records what it routed instead of what the engine reports: the prompt's block hashes
are assumed cached on the chosen (worker, rank) for ``ttl`` seconds (default 120), refreshed each
time a request with that prefix goes there again. ``find_matches`` answers like ``KvIndexer``'s.
It over-estimates when the engine evicts early and under-estimates when a prefix outlives the
TTL; the TTL bounds the first error.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from .hashing import block_hashes

__all__ = ["DEFAULT_TTL", "ApproxIndexer"]

#: Seconds a routed prefix is assumed to stay cached.
DEFAULT_TTL = 120.0

Key = tuple[int, int]


class ApproxIndexer:
    """Prefix index fed by routing decisions, with a TTL per block.

    Args:
        block_size: tokens per KV block.
        ttl: seconds a recorded block counts as cached.
        clock: monotonic time source (injectable for tests).
    """

    def __init__(
        self, block_size: int, ttl: float = DEFAULT_TTL, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not ttl > 0:
            raise ValueError(f"ttl must be > 0, got {ttl}")
        self.block_size = block_size
        self.ttl = ttl
        self._clock = clock
        # Per key, hash -> expiry in insertion (= expiry) order: a refresh moves it to the end.
        self._by_key: dict[Key, OrderedDict[int, float]] = {}
        self._holders: dict[int, set[Key]] = {}

    def record(
        self, key: Key, token_ids: Sequence[int] | None = None, hashes: Sequence[int] | None = None
    ) -> None:
        """Assume the prompt's full blocks are cached on ``key`` from now for ``ttl`` seconds.

        Pass ``hashes`` when already computed (``block_hashes(token_ids, block_size)``).
        """
        if hashes is None:
            hashes = block_hashes(list(token_ids or ()), self.block_size)
        now = self._clock()
        self._expire(now)
        expiry = now + self.ttl
        blocks = self._by_key.get(key)
        if blocks is None:
            blocks = self._by_key[key] = OrderedDict()
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                self._holders.setdefault(h, set()).add(key)
            blocks[h] = expiry

    def find_matches(self, token_ids: Sequence[int]) -> dict[Key, int]:
        """Cached prefix blocks of ``token_ids`` per (worker, rank), omitting zeros."""
        return self.find_matches_for_hashes(block_hashes(list(token_ids), self.block_size))

    def find_matches_for_hashes(self, hashes: Sequence[int]) -> dict[Key, int]:
        self._expire(self._clock())
        matches: dict[Key, int] = {}
        alive: set[Key] | None = None
        for depth, h in enumerate(hashes, 1):
            holders = self._holders.get(h)
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for key in alive:
                matches[key] = depth
        return matches

    def keys(self) -> list[Key]:
        self._expire(self._clock())
        return [k for k, blocks in self._by_key.items() if blocks]

    def num_blocks(self, key: Key | None = None) -> int:
        self._expire(self._clock())
        if key is not None:
            return len(self._by_key.get(key, ()))
        return sum(len(b) for b in self._by_key.values())

    def clear(self, key: Key) -> None:
        blocks = self._by_key.pop(key, None)
        for h in blocks or ():
            self._forget(h, key)

    def remove_worker(self, worker_id: int) -> None:
        for key in [k for k in self._by_key if k[0] == worker_id]:
            self.clear(key)

    def _forget(self, h: int, key: Key) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(key)
            if not holders:
                del self._holders[h]

    def _expire(self, now: float) -> None:
        for key, blocks in self._by_key.items():
            while blocks:
                h, expiry = next(iter(blocks.items()))
                if expiry > now:
                    break
                del blocks[h]
                self._forget(h, key)
