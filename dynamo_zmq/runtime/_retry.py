"""``RetryingStream``: a request's responses that move to another instance when the one serving
it fails retryably before its first item. The client's failover and the KV router's re-routing
are both this stream; they differ only in the ``reopen`` function they give it."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from .. import errors
from ..context import Context
from ..transport import ResponseStream
from ..transport._streams import MAX_BATCH_ITEMS

__all__ = ["MAX_ATTEMPTS", "Reopen", "RetryingStream"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Instances a request is tried on when each fails retryably before its first response.
MAX_ATTEMPTS = 3

Reopen = Callable[[frozenset[int]], Awaitable["ResponseStream[T] | None"]]
"""Sends the request again to an instance outside the given ids; None if there is none."""


class RetryingStream(Generic[T]):
    """Iterates ``first``; on a retryable error before the first item, asks ``reopen`` for a
    stream on another instance (at most ``MAX_ATTEMPTS`` instances in all, never after the
    request's context stopped). Once an item has been delivered the stream is committed: later
    errors are raised as they are.

    Args:
        first: the stream of the first attempt.
        reopen: opens the next attempt on an instance not tried yet.
        on_item: called with each item delivered to the caller.
        on_end: called when an attempt ends (exhausted, failed or closed; maybe more than once).
    """

    def __init__(
        self,
        first: ResponseStream[T],
        reopen: Reopen[T],
        *,
        on_item: Callable[[T], object] | None = None,
        on_end: Callable[[], object] | None = None,
    ) -> None:
        self._stream = first
        self._reopen = reopen
        self._on_item = on_item
        self._on_end = on_end
        self._tried = {first.instance_id}
        self._started = False

    @property
    def context(self) -> Context:
        return self._stream.context

    @property
    def instance_id(self) -> int:
        """The instance serving the request now."""
        return self._stream.instance_id

    def __aiter__(self) -> RetryingStream[T]:
        return self

    async def __anext__(self) -> T:
        while True:
            try:
                item = await self._stream.__anext__()
            except errors.DynamoError as exc:
                if not await self._retry(exc):
                    raise
                continue
            except BaseException:  # StopAsyncIteration, cancellation, bugs
                self._ended()
                raise
            self._deliver(item)
            return item

    async def next_batch(self, max_items: int = MAX_BATCH_ITEMS) -> list[T]:
        """Every item that has arrived, at least one (waits); ``[]`` at the end."""
        while True:
            try:
                items = await self._stream.next_batch(max_items)
            except errors.DynamoError as exc:
                if not await self._retry(exc):
                    raise
                continue
            except BaseException:
                self._ended()
                raise
            if not items:
                self._ended()
            for item in items:
                self._deliver(item)
            return items

    async def aclose(self) -> None:
        self._ended()
        await self._stream.aclose()

    async def _retry(self, exc: errors.DynamoError) -> bool:
        """After ``exc`` ended the current attempt: open the next one if allowed (True)."""
        self._ended()
        if not (
            exc.retryable
            and not self._started
            and len(self._tried) < MAX_ATTEMPTS
            and not self._stream.context.is_stopped()
        ):
            return False
        log.info("request failed on instance %x before responding (%r): retrying",
                 self.instance_id, exc)
        stream = await self._reopen(frozenset(self._tried))
        if stream is None:
            return False
        self._stream = stream
        self._tried.add(stream.instance_id)
        return True

    def _deliver(self, item: T) -> None:
        self._started = True
        if self._on_item is not None:
            self._on_item(item)

    def _ended(self) -> None:
        if self._on_end is not None:
            self._on_end()
