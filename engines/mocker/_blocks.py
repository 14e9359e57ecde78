"""Paged KV blocks of one data-parallel rank, with a prefix cache.

Every block is in exactly one of three states:

- **free**: unused and holding nothing reusable (never used, or used without a hash);
- **active**: referenced by at least one running sequence (``ref > 0``);
- **cached**: unreferenced but holding a full block with a hash; a new request whose prefix
  hashes to it can revive it instead of recomputing it. Cached blocks form an LRU pool that is
  evicted (oldest first, a ``BlockRemoved`` event each) when the free list runs dry.

Full blocks get their hash through ``cache_blocks`` once their KV is computed (a ``BlockStored``
event per run of new hashes). A hash is held by at most one block: a block whose content is
already cached elsewhere stays private (vLLM keeps the duplicate and publishes it twice; the
mocker keeps the simpler one-to-one map, so every removal names a hash that was stored).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from ._kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

__all__ = ["BlockManager"]


class BlockManager:
    """Allocation, reference counts and the prefix cache of ``num_blocks`` blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._free: collections.deque[int] = collections.deque(range(num_blocks))
        #: Cached (ref 0, hashed) block ids, least recently freed first.
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()
        #: Hash -> block id, for active and cached blocks alike.
        self._by_hash: dict[int, int] = {}
        self._events: list[KvEvent] = []
        self.num_active = 0

    # -- state ------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_available(self) -> int:
        """Blocks an allocation may take: free ones, then evicted cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running sequences."""
        return self.num_active / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> int | None:
        return self._hash[block_id]

    def cached_hashes(self) -> dict[int, int]:
        """A copy of the hash -> block id map (active and cached blocks)."""
        return dict(self._by_hash)

    # -- allocation -------------------------------------------------------------------------

    def match_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest prefix of ``hashes`` held in the cache (no reference taken)."""
        if not self.enable_caching:
            return []
        found: list[int] = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def allocate(self, num_new: int, hits: Sequence[int] = ()) -> list[int] | None:
        """Reference the prefix-hit blocks ``hits`` and ``num_new`` fresh blocks.

        Returns ``[*hits, *new]``, or None (and changes nothing) when not enough blocks are
        available. Fresh blocks come from the free list first, then from the cached pool's LRU
        end (evicting those entries).
        """
        reviving = sum(1 for b in hits if self._ref[b] == 0)
        if num_new < 0 or num_new > self.num_available - reviving:
            return None
        for b in hits:
            if self._ref[b] == 0:
                del self._cached[b]
                self.num_active += 1
            self._ref[b] += 1
        new = [self._take() for _ in range(num_new)]
        return [*hits, *new]

    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._cached.popitem(last=False)
            h = self._hash[block]
            assert h is not None
            self._hash[block] = None
            del self._by_hash[h]
            self._record_removed(h)
        self._ref[block] = 1
        self.num_active += 1
        return block

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block, tail first, so a sequence's last blocks are evicted
        before its first ones (a shared prefix outlives the suffixes)."""
        for block in reversed(blocks):
            ref = self._ref[block] - 1
            if ref < 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            self._ref[block] = ref
            if ref == 0:
                self.num_active -= 1
                if self._hash[block] is not None:
                    self._cached[block] = None
                else:
                    self._free.append(block)

    # -- prefix cache -----------------------------------------------------------------------

    def cache_blocks(self, blocks: Sequence[int], hashes: Sequence[int], parent: int | None,
                     token_ids: Sequence[int], own_hashes: Sequence[int] | None = None,
                     lora_name: str | None = None) -> int:
        """Give full, computed blocks their hashes; returns how many became cached.

        ``hashes[i]`` is the chained hash of ``blocks[i]``, ``parent`` the hash of the block
        before ``blocks[0]`` (None at the start of a sequence), ``token_ids`` all their tokens,
        ``own_hashes[i]`` (if given) the router's hash of ``blocks[i]``, published with it,
        ``lora_name`` the LoRA adapter they were computed with (in their ``BlockStored``).
        Each run of newly stored blocks becomes one ``BlockStored`` event.
        """
        if not self.enable_caching:
            return 0
        size = self.block_size
        stored = 0
        run: BlockStored | None = None
        prev = parent
        for i, (block, h) in enumerate(zip(blocks, hashes, strict=True)):
            if self._hash[block] is None and h not in self._by_hash:
                self._hash[block] = h
                self._by_hash[h] = block
                stored += 1
                tokens = token_ids[i * size : (i + 1) * size]
                if run is None:
                    run = BlockStored([], prev, [], size, lora_name=lora_name,
                                      own_hashes=None if own_hashes is None else [])
                    self._events.append(run)
                run.block_hashes.append(h)
                run.token_ids.extend(tokens)
                if run.own_hashes is not None and own_hashes is not None:
                    run.own_hashes.append(own_hashes[i])
            else:
                run = None
            prev = h
        return stored

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (``AllBlocksCleared``); refused while any block is active."""
        if self.num_active:
            return False
        for block in self._cached:
            self._hash[block] = None
            self._free.append(block)
        self._cached.clear()
        self._by_hash.clear()
        if self.enable_caching:
            self._events.append(AllBlocksCleared())
        return True

    def clear_cached(self) -> int:
        """Forget every cached (unreferenced) block; returns how many. With no block active this
        is ``reset_prefix_cache`` (one ``AllBlocksCleared``); otherwise each dropped block gets
        its ``BlockRemoved`` and the blocks in use keep their hashes."""
        dropped = len(self._cached)
        if not self.num_active:
            self.reset_prefix_cache()
            return dropped
        for block in self._cached:
            h = self._hash[block]
            assert h is not None
            self._hash[block] = None
            del self._by_hash[h]
            self._record_removed(h)
            self._free.append(block)
        self._cached.clear()
        return dropped

    def _record_removed(self, h: int) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(h)
        else:
            self._events.append(BlockRemoved([h]))

    def take_events(self) -> list[KvEvent]:
        """The events recorded since the last call, oldest first."""
        events, self._events = self._events, []
        return events
