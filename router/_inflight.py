"""Prefix matches of requests in flight: what a rank is about to cache, before its KV events say.

The event-driven index learns a prompt's blocks only from the engine's ``BlockStored`` events,
published once the blocks are computed (after queueing and prefill, plus the event's trip). Until
then a second request with the same prefix finds no match there and is routed by load, often to
another rank, which computes the prefix again: in a burst of requests sharing a prefix, the
approximate mode (which records its own decisions at once) keeps them together and the
event-driven one scatters them. The router knows what it routed: every active request's prompt
blocks are counted in ``LoadTracker`` per rank, and an engine holds a running request's blocks
(they cannot be evicted), so they count as matched there too. With chained block hashes, a
rank holding ``hashes[d]`` for an active request holds the whole prefix ``hashes[:d + 1]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .scheduler import Candidate, LoadTracker

__all__ = ["with_inflight"]


def with_inflight(
    matches: Mapping[Candidate, int],
    hashes: Sequence[int],
    candidates: Sequence[Candidate],
    loads: LoadTracker,
) -> dict[Candidate, int]:
    """``matches`` (the index's prefix blocks per candidate), each extended past its end while
    the next block is held by an active request routed to that candidate."""
    out = dict(matches)
    n = len(hashes)
    for c in candidates:
        active = loads.active_blocks(c)
        if not active:
            continue
        d = out.get(c, 0)
        start = d
        while d < n and hashes[d] in active:
            d += 1
        if d > start:
            out[c] = d
    return out
