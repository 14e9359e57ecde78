"""``RetryingStream``: a response stream that moves to another instance when the one serving it
fails retryably before its first item. ``Client``'s failover and the KV router's re-routing are
both this, differing only in how they open the next attempt."""

from __future__ import annotations

import logging
from typing import Any

from .. import errors
from ..context import Context
from ..transport import ResponseStream

__all__ = ["MAX_ATTEMPTS", "RetryingStream"]

log = logging.getLogger(__name__)

#: Instances a request is tried on when each fails retryably before its first response.
MAX_ATTEMPTS = 3


class RetryingStream:
    """Iterates ``stream``; on a retryable error before the first item, asks ``_reopen`` for a
    stream on another instance (at most ``MAX_ATTEMPTS`` instances in all, never after the
    request's context stopped). Once an item has been delivered the stream is committed: later
    errors are raised as they are.

    Subclasses implement ``_reopen`` and may hook ``_on_item`` (each delivered item) and
    ``_on_end`` (the current attempt is over: exhausted, failed, or closed).
    """

    def __init__(self, stream: ResponseStream, tried: set[int] | None = None) -> None:
        self._stream = stream
        self._tried = (tried or set()) | {stream.instance_id}
        self._started = False

    @property
    def context(self) -> Context:
        return self._stream.context

    @property
    def instance_id(self) -> int:
        """The instance now serving the request."""
        return self._stream.instance_id

    def __aiter__(self) -> RetryingStream:
        return self

    async def __anext__(self) -> Any:
        while True:
            try:
                item = await self._stream.__anext__()
            except errors.DynamoError as exc:
                self._on_end()
                if not self._may_retry(exc):
                    raise
                log.info("request failed on instance %x before responding (%r): retrying",
                         self.instance_id, exc)
                stream = await self._reopen()
                if stream is None:
                    raise
                self._stream = stream
                self._tried.add(stream.instance_id)
                continue
            except BaseException:  # StopAsyncIteration, cancellation, bugs
                self._on_end()
                raise
            self._started = True
            self._on_item(item)
            return item

    def next_nowait(self) -> Any:
        """The next item if it has already arrived, else ``ResponseStream.EMPTY``."""
        item = self._stream.next_nowait()
        if item is not ResponseStream.EMPTY:
            self._started = True
            self._on_item(item)
        return item

    async def aclose(self) -> None:
        self._on_end()
        await self._stream.aclose()

    def _may_retry(self, exc: errors.DynamoError) -> bool:
        return (
            exc.retryable
            and not self._started
            and len(self._tried) < MAX_ATTEMPTS
            and not self._stream.context.is_stopped()
        )

    async def _reopen(self) -> ResponseStream | None:
        """A stream for the same request on an instance not in ``self._tried``, or ``None`` if
        there is none (the original error is then raised)."""
        raise NotImplementedError

    def _on_item(self, item: Any) -> None:
        """Called with each item delivered to the caller."""

    def _on_end(self) -> None:
        """Called when the current attempt ends (it may be called more than once)."""
