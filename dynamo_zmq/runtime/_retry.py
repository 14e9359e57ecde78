"""Failover: a request whose instance fails retryably before its first response is sent again
to another instance. The client's round-robin and random calls and the KV router both use it;
they differ only in how they open the next attempt (``open_elsewhere``)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from .. import errors
from ..transport import Reopen, ResponseStream

__all__ = ["MAX_ATTEMPTS", "failover"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Instances a request is tried on when each fails retryably before its first response.
MAX_ATTEMPTS = 3


def failover(
    first: ResponseStream[T],
    open_elsewhere: Callable[[frozenset[int]], Awaitable[ResponseStream[T] | None]],
    exclude: frozenset[int] = frozenset(),
) -> ResponseStream[T]:
    """Give ``first`` a ``reopen`` hook: on a retryable error before any item, send the request
    to an instance not tried yet (``open_elsewhere(tried)``; None if there is none), at most
    ``MAX_ATTEMPTS`` instances in all, never once the request's context is stopped. Returns
    ``first``, which continues on the new attempt; once an item has arrived errors reach the
    caller as they are. ``exclude``: instances the request must not go to (they count as
    tried, not as attempts)."""
    tried = {first.instance_id, *exclude}
    limit = MAX_ATTEMPTS + len(exclude - {first.instance_id})

    async def reopen(
        stream: ResponseStream[T], exc: errors.DynamoError
    ) -> ResponseStream[T] | None:
        if not exc.retryable or len(tried) >= limit or stream.context.is_stopped():
            return None
        log.info("request failed on instance %x before responding (%r): retrying",
                 stream.instance_id, exc)
        other = await open_elsewhere(frozenset(tried))
        if other is not None:
            tried.add(other.instance_id)
        return other

    hook: Reopen[T] = reopen
    first.set_reopen(hook)
    return first
