"""Prompt matching over the indexer's bitmasks: how many leading blocks each key holds.

``masks`` maps an own block hash (a whole prefix, see ``router.hashing``) to the int bitmask of
the keys holding it; ``bit_keys`` maps each key's bit back to its ``(worker_id, dp_rank)``.
Both functions return ``{key: matched leading blocks}`` for keys with at least one block.

* ``prefix_matches``: when no key holding the first block has orphans, each key's held blocks
  along the prompt form a prefix, so each drop of the key set is found by binary search:
  O(distinct match lengths x log(blocks)) dict lookups.
* ``linear_matches``: exact in every case (orphans, poisoned keys): masks looked up and
  prefix-ANDed in C (``map`` + ``itertools.accumulate``), in growing chunks so that a total
  mismatch stops it early, then the drop points are bisected.
"""

from __future__ import annotations

import itertools
import operator
from bisect import bisect_right
from collections.abc import Sequence

__all__ = ["linear_matches", "prefix_matches"]

WorkerKey = tuple[int, int]
#: First chunk of prompt blocks looked up at once by ``linear_matches``; doubles after each.
FIRST_CHUNK = 32

_and = operator.and_
_neg = operator.neg


def _drop(out: dict[WorkerKey, int], bit_keys: dict[int, WorkerKey], dropped: int, at: int) -> None:
    """Record ``at`` matched blocks for every key whose bit is in ``dropped``."""
    while dropped:
        low = dropped & -dropped
        out[bit_keys[low]] = at
        dropped ^= low


def prefix_matches(masks: dict[int, int], bit_keys: dict[int, WorkerKey],
                   own_hashes: Sequence[int], first: int) -> dict[WorkerKey, int]:
    """Matches when every key in ``first`` (the first block's mask) holds a prefix of the
    prompt, i.e. none of them has orphans."""
    get = masks.get
    n = len(own_hashes)
    out: dict[WorkerKey, int] = {}
    v, lo = first, 1
    while True:  # v: keys holding blocks [0, lo); find where the next of them drops out
        hi = n
        if get(own_hashes[n - 1], 0) & v != v:
            while lo < hi:
                mid = (lo + hi) >> 1
                if get(own_hashes[mid], 0) & v == v:
                    lo = mid + 1
                else:
                    hi = mid
        else:
            lo = n
        nxt = get(own_hashes[lo], 0) & v if lo < n else 0
        _drop(out, bit_keys, v & ~nxt, lo)
        if not nxt:
            return out
        v, lo = nxt, lo + 1


def linear_matches(masks: dict[int, int], bit_keys: dict[int, WorkerKey],
                   own_hashes: Sequence[int]) -> dict[WorkerKey, int]:
    """Exact matches by the prefix-AND of every block's mask."""
    get = masks.get
    n = len(own_hashes)
    zero = itertools.repeat(0)
    acc: list[int] = []
    running, start, chunk = -1, 0, FIRST_CHUNK
    while start < n:
        end = min(n, start + chunk)
        part = list(itertools.accumulate(map(get, own_hashes[start:end], zero), _and,
                                         initial=running))
        running = part[-1]
        acc += part[1:]
        if not running:
            break
        start, chunk = end, chunk * 2
    # acc is non-increasing; walk its drop points (at most one per key).
    out: dict[WorkerKey, int] = {}
    size, i = len(acc), 0
    while i < size:
        v = acc[i]
        if not v:
            break
        j = bisect_right(acc, -v, lo=i, key=_neg)
        _drop(out, bit_keys, v & ~acc[j] if j < size else v, j)
        i = j
    return out
