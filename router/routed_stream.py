"""``RoutedStream``: the response stream of a request the KV router placed.

It keeps ``Client.generate``'s stream contract and adds the router's bookkeeping: the request's
predicted load is released exactly once, at the terminal item, an error, ``aclose`` or garbage
collection; a worker that fails retryably before its first response gets the request re-routed
to the next best (worker, dp_rank).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import msgspec

from dynamo_zmq import errors
from dynamo_zmq.llm import PreprocessedRequest
from dynamo_zmq.runtime import RetryingStream
from dynamo_zmq.transport import Response, ResponseStream

from .scheduler import Route

if TYPE_CHECKING:
    from .kv_router import Decision, KvRouter

__all__ = ["RoutedStream"]


class RoutedStream(RetryingStream):
    """The response stream of a routed request: ``Client.generate``'s contract, plus the load
    bookkeeping (released at the terminal item, an error, ``aclose`` or garbage collection)
    and re-routing if the worker fails retryably before its first response."""

    def __init__(
        self,
        router: KvRouter,
        request: PreprocessedRequest,
        hashes: list[int],
        stream: ResponseStream,
        decision: Decision,
        route: Route,
        tried: set[int],
        options: dict[str, Any],
    ) -> None:
        super().__init__(stream, tried | {decision.worker_id})
        self._router = router
        self._request = request
        self._hashes = hashes
        self.decision = decision
        self._options = options
        # Releases the load even if the stream is dropped unread (and never iterated again).
        self._finalizer = weakref.finalize(self, router.loads.release, route)

    @property
    def dp_rank(self) -> int:
        return self.decision.dp_rank

    @property
    def routed_header(self) -> bytes:
        """``<instance hex>/<dp rank>``: the frontend's ``x-dynamo-worker`` header."""
        return f"{self.decision.worker_id:x}/{self.decision.dp_rank}".encode()

    def _on_item(self, item: Any) -> None:
        if _is_terminal(item):
            self._finalizer()

    def _on_end(self) -> None:
        self._finalizer()

    async def _reopen(self) -> ResponseStream | None:
        router = self._router
        try:
            decision, route = router._route(self._request, self._hashes, self._tried)
        except errors.CannotConnect:
            return None
        try:
            stream = await router.client.direct(
                self._request, decision.worker_id, context=self._stream.context, **self._options
            )
        except errors.CannotConnect:
            router.loads.release(route)
            return None
        self.decision = decision
        self._finalizer = weakref.finalize(self, router.loads.release, route)
        return stream


class _Finish(msgspec.Struct, gc=False):
    finish_reason: str | None = None


_finish_decoder = msgspec.msgpack.Decoder(_Finish)


def _is_terminal(item: Any) -> bool:
    """Does this response item carry a ``finish_reason`` (LLMEngineOutput's terminal)?"""
    try:
        if isinstance(item, Response):
            return _finish_decoder.decode(item.payload).finish_reason is not None
        if isinstance(item, dict):
            return item.get("finish_reason") is not None
        return getattr(item, "finish_reason", None) is not None
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
