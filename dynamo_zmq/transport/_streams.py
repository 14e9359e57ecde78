"""Response streams on the calling side: one request's items as they arrive, decoded once.

``ResponseStream`` is what a ``PeerConnection`` returns for one request. Its items are decoded by
the function given when the request was sent: ``Response`` (Dynamo's annotated item, decoded on
``data()``), ``decode_item`` (plain values), or a typed msgspec decoder (``item_decoder(T)``),
so a caller that knows the item type gets validated objects and nothing decodes twice.
``ItemStream`` is the interface every stream of items implements (this one, and the runtime's
retrying stream on top of it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import msgspec

from .. import errors
from ..context import Context
from ..wire import Control, Credit, Kind, decode_item

if TYPE_CHECKING:
    from .client import PeerConnection

__all__ = ["ItemDecoder", "ItemStream", "Response", "ResponseStream", "item_decoder"]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

ItemDecoder = Callable[[msgspec.Raw], T]
"""Turns one item's MessagePack bytes into what the stream yields."""

#: Most items ``next_batch`` returns at once (one DATA frame holds at most 256).
MAX_BATCH_ITEMS = 256

_typed_decoders: dict[Any, Callable[[msgspec.Raw], Any]] = {}


def item_decoder(item_type: type[T]) -> ItemDecoder[T]:
    """A decoder validating items into ``item_type`` (built once per type)."""
    decode = _typed_decoders.get(item_type)
    if decode is None:
        decode = _typed_decoders[item_type] = msgspec.msgpack.Decoder(item_type).decode
    return decode


class ItemStream(Protocol[T_co]):
    """A request's response items: iterate them, or take what has arrived in batches."""

    @property
    def context(self) -> Context: ...

    @property
    def instance_id(self) -> int:
        """The instance serving the request now."""
        ...

    def __aiter__(self) -> ItemStream[T_co]: ...

    async def __anext__(self) -> T_co: ...

    async def next_batch(self, max_items: int = MAX_BATCH_ITEMS) -> list[T_co]:
        """Wait for at least one item and return every item that has arrived (up to
        ``max_items``); an empty list once the stream has ended. Errors raise as from
        ``__anext__``."""
        ...

    async def aclose(self) -> None: ...


class Response:
    """One streamed item; ``data()`` decodes it on first use (Dynamo's annotated response)."""

    __slots__ = ("_raw", "_value")

    _UNSET: Any = object()

    def __init__(self, raw: msgspec.Raw) -> None:
        self._raw = raw
        self._value = Response._UNSET

    def data(self) -> Any:
        if self._value is Response._UNSET:
            self._value = decode_item(self._raw)
        return self._value

    def raw(self) -> bytes:
        return bytes(self._raw)

    def __repr__(self) -> str:
        return f"Response({self.data()!r})"


class _StreamState:
    """What the connection knows of one open request (it fills ``items``; the stream drains)."""

    __slots__ = (
        "done",
        "error",
        "expected_seq",
        "items",
        "request_id",
        "unconsumed_credit",
        "unlink",
        "waiter",
        "window",
    )

    def __init__(self, request_id: int, window: int) -> None:
        self.request_id = request_id
        self.window = window
        self.items: deque[msgspec.Raw] = deque()
        self.expected_seq = 0
        self.done = False
        self.error: errors.DynamoError | None = None
        self.waiter = asyncio.Event()
        self.unconsumed_credit = 0
        self.unlink: Callable[[], None] | None = None

    def terminate(self, error: errors.DynamoError | None) -> None:
        if not self.done:
            self.done = True
            self.error = error
            self.waiter.set()
        if self.unlink is not None:
            self.unlink()
            self.unlink = None


class ResponseStream(Generic[T]):
    """Async iterator over one request's responses. Leaving it early kills the request.

    An item that does not decode with the stream's decoder kills the request and raises
    ``errors.Unknown`` (the peer sent something other than what the caller expects).
    """

    def __init__(
        self,
        conn: PeerConnection,
        state: _StreamState,
        ctx: Context,
        decode: ItemDecoder[T],
        idle_timeout: float | None,
    ) -> None:
        self._conn = conn
        self._st = state
        self._ctx = ctx
        self._decode = decode
        self._idle_timeout = idle_timeout
        self._closed = False

    @property
    def context(self) -> Context:
        return self._ctx

    @property
    def instance_id(self) -> int:
        return self._conn.instance_id

    def __aiter__(self) -> ResponseStream[T]:
        return self

    async def __anext__(self) -> T:
        await self._wait_item()
        return self._pop()

    async def next_batch(self, max_items: int = MAX_BATCH_ITEMS) -> list[T]:
        """Every item that has arrived, at least one (waits), at most ``max_items``; ``[]`` at
        the end of the stream."""
        try:
            await self._wait_item()
        except StopAsyncIteration:
            return []
        items = self._st.items
        return [self._pop() for _ in range(min(len(items), max_items))]

    async def aclose(self) -> None:
        """Stop listening; if the stream was still open, the server's context is killed."""
        if not self._st.done:
            self._conn._send_control(Kind.KILL, Control(self._st.request_id))
            self._st.terminate(errors.Cancelled("stream closed by the caller"))
        self._release()

    async def _wait_item(self) -> None:
        """Return once an item is queued; raise the stream's error or StopAsyncIteration."""
        st = self._st
        while not st.items:
            if st.done:
                self._release()
                if st.error is not None:
                    raise st.error
                raise StopAsyncIteration
            st.waiter.clear()
            if self._idle_timeout is None:
                await st.waiter.wait()
                continue
            try:
                await asyncio.wait_for(st.waiter.wait(), self._idle_timeout)
            except asyncio.TimeoutError:
                self._conn._send_control(Kind.KILL, Control(st.request_id))
                st.terminate(errors.ResponseTimeout(f"no response within {self._idle_timeout}s"))

    def _pop(self) -> T:
        st = self._st
        raw = st.items.popleft()
        st.unconsumed_credit += 1
        if st.unconsumed_credit >= st.window // 2 and not st.done:
            self._conn._send_control(Kind.CREDIT, Credit(st.request_id, st.unconsumed_credit))
            st.unconsumed_credit = 0
        try:
            return self._decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            error = errors.Unknown(f"undecodable response item: {exc}")
            if not st.done:
                self._conn._send_control(Kind.KILL, Control(st.request_id))
            st.items.clear()
            st.terminate(error)
            self._release()
            raise error from exc

    def _release(self) -> None:
        if not self._closed:
            self._closed = True
            self._conn._streams.pop(self._st.request_id, None)

    def __del__(self) -> None:
        # Dropped without being read to the end: the caller is gone, so is the request. Release
        # it even when its terminal already arrived, or the connection keeps it forever.
        if not self._closed:
            with contextlib.suppress(Exception):
                if not self._st.done:
                    self._conn._send_control(Kind.KILL, Control(self._st.request_id))
                    self._st.terminate(None)
                self._release()
