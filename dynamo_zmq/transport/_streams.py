"""Response streams on the calling side: one request's items as they arrive, decoded once.

``ResponseStream`` is what a ``PeerConnection`` returns for one request. Each DATA frame's items
arrive as one MessagePack array and are decoded in one call, as they arrive, by the decoder
given when the request was sent: ``response_items`` (Dynamo's annotated ``Response``, each
decoded on ``data()``), ``plain_items`` (plain values), or a typed msgspec decoder
(``item_decoder(T)``), so a caller that knows the item type gets validated objects and nothing
decodes twice. ``ItemStream`` is the interface every stream of items implements (this one, and
the runtime's retrying stream on top of it).
"""

from __future__ import annotations

import asyncio
import contextlib
import types
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from .. import errors
from ..context import Context
from ..wire import Control, Credit, Kind, decode_item

__all__ = [
    "ItemDecoder",
    "ItemStream",
    "Reopen",
    "Response",
    "ResponseStream",
    "StreamHost",
    "item_decoder",
    "plain_items",
    "response_items",
]

T = TypeVar("T")

ItemDecoder = Callable[[msgspec.Raw], list[T]]
"""Turns one DATA frame's items (a MessagePack array) into what the stream yields."""

#: Most items ``next_batch`` returns at once (one DATA frame holds at most 256).
MAX_BATCH_ITEMS = 256

_typed_decoders: dict[Any, Callable[[msgspec.Raw], Any]] = {}
_raw_items = msgspec.msgpack.Decoder(list[msgspec.Raw]).decode

plain_items: ItemDecoder[Any] = msgspec.msgpack.Decoder(list[Any]).decode
"""Items as plain Python values (what ``decode_item`` makes of each)."""


def item_decoder(item_type: type[T]) -> ItemDecoder[T]:
    """A decoder validating items into ``item_type`` (built once per type)."""
    decode = _typed_decoders.get(item_type)
    if decode is None:
        # ``list[item_type]`` built at run time (a type variable's value is no static type)
        list_type = types.GenericAlias(list, (item_type,))
        decode = _typed_decoders[item_type] = msgspec.msgpack.Decoder(list_type).decode
    return decode


def response_items(raw: msgspec.Raw) -> list[Response]:
    """Items as ``Response`` objects, each decoded on first ``data()`` (Dynamo's form)."""
    return [Response(item) for item in _raw_items(raw)]


def decode_items(
    decode: ItemDecoder[T], raw: msgspec.Raw
) -> tuple[list[T], errors.DynamoError | None]:
    """The items of one frame, and the error that ends the stream if one does not decode: the
    items before it are still delivered (decoded one by one to find it)."""
    try:
        return decode(raw), None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        pass
    good: list[T] = []
    try:
        for item in _raw_items(raw):
            good.extend(decode(msgspec.Raw(b"\x91" + bytes(item))))  # a one-item array
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        return good, errors.Unknown(f"undecodable response item: {exc}")
    return good, errors.Unknown("undecodable response items")


class ItemStream(Protocol[T]):
    """A request's response items: iterate them, or take what has arrived in batches."""

    @property
    def context(self) -> Context: ...

    @property
    def instance_id(self) -> int:
        """The instance serving the request now."""
        ...

    def __aiter__(self) -> AsyncIterator[T]: ...

    async def __anext__(self) -> T: ...

    async def next_batch(self, max_items: int = MAX_BATCH_ITEMS) -> list[T]:
        """Wait for at least one item and return every item that has arrived (up to
        ``max_items``); an empty list once the stream has ended. Errors raise as from
        ``__anext__``."""
        ...

    async def aclose(self) -> None: ...


class StreamHost(Protocol):
    """What a stream needs of the connection its request went out on (``PeerConnection``)."""

    @property
    def instance_id(self) -> int: ...

    def send_control(self, kind: bytes, msg: msgspec.Struct) -> None:
        """Send STOP, KILL or CREDIT for a stream, without waiting."""
        ...

    def forget_stream(self, request_id: int) -> None:
        """Stop tracking the stream ``request_id`` (its caller is done with it)."""
        ...


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
        "decode",
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

    def __init__(self, request_id: int, window: int, decode: ItemDecoder[Any]) -> None:
        self.request_id = request_id
        self.window = window
        #: Turns a DATA frame's items into what the stream yields.
        self.decode = decode
        self.items: deque[Any] = deque()
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


Reopen = Callable[["ResponseStream[T]", errors.DynamoError], Awaitable["ResponseStream[T] | None"]]
"""Called with a stream and its error when it fails before its first item: the same request on
another instance (a new stream the failed one takes over), or None to let the error reach the
caller. (It gets the stream as an argument so that it need not hold it: a hook that held its
stream would keep it alive after the caller dropped it.)"""


class ResponseStream(Generic[T]):
    """Async iterator over one request's responses. Leaving it early kills the request.

    Items are decoded as their frame arrives (``_StreamState.decode``). An item that does not
    decode kills the request: the items before it are delivered, then ``errors.Unknown`` is
    raised (the peer sent something other than what the caller expects).

    Hooks, for the runtime's failover and for routers:

    - ``reopen`` (``set_reopen``): when the stream fails before any item arrived, it may send
      the request again elsewhere; the stream then continues on that attempt, and the caller
      never sees the first one (``instance_id`` names the instance serving it now).
    - ``on_item`` (``set_on_item``): called with each item as it is handed to the caller.
    - ``on_release`` (``set_on_release``): called once when the stream is done with, however
      it ends (its end, an error, ``aclose``, or being dropped unread).
    """

    def __init__(
        self,
        conn: StreamHost,
        state: _StreamState,
        ctx: Context,
        idle_timeout: float | None,
    ) -> None:
        self._conn = conn
        self._st = state
        self._ctx = ctx
        self._idle_timeout = idle_timeout
        self._closed = False
        self._half_window = max(1, state.window // 2)
        self._reopen: Reopen[T] | None = None
        self._on_item: Callable[[T], object] | None = None
        self._on_release: Callable[[], object] | None = None
        self._loop = asyncio.get_running_loop()

    def set_reopen(self, reopen: Reopen[T] | None) -> None:
        """What to do when the stream fails before its first item (see the class docstring)."""
        self._reopen = reopen

    def set_on_item(self, on_item: Callable[[T], object] | None) -> None:
        """Called with each item as the caller gets it (see the class docstring)."""
        self._on_item = on_item

    def set_on_release(self, on_release: Callable[[], object] | None) -> None:
        """Called once when the stream is released (see the class docstring)."""
        self._on_release = on_release

    @property
    def context(self) -> Context:
        return self._ctx

    @property
    def instance_id(self) -> int:
        return self._conn.instance_id

    def __aiter__(self) -> AsyncIterator[T]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[T]:
        # An async generator: ``async for`` costs less per item than a coroutine per
        # ``__anext__`` call. Reads the same state as ``__anext__``, so both can be mixed.
        half = self._half_window
        while True:
            st = self._st  # another attempt's after a reopen
            items = st.items
            on_item = self._on_item
            while items:
                item = items.popleft()
                st.unconsumed_credit += 1
                if st.unconsumed_credit >= half:
                    self._grant()
                if on_item is not None:
                    on_item(item)
                yield item
            try:
                await self._wait_item()
            except StopAsyncIteration:
                return

    async def __anext__(self) -> T:
        st = self._st
        if not st.items:
            await self._wait_item()
            st = self._st
        item: T = st.items.popleft()
        st.unconsumed_credit += 1
        if st.unconsumed_credit >= self._half_window:
            self._grant()
        if self._on_item is not None:
            self._on_item(item)
        return item

    async def next_batch(self, max_items: int = MAX_BATCH_ITEMS) -> list[T]:
        """Every item that has arrived, at least one (waits), at most ``max_items``; ``[]`` at
        the end of the stream."""
        if not self._st.items:
            try:
                await self._wait_item()
            except StopAsyncIteration:
                return []
        st = self._st
        items = st.items
        if len(items) <= max_items:
            batch: list[T] = list(items)
            items.clear()
        else:
            batch = [items.popleft() for _ in range(max_items)]
        st.unconsumed_credit += len(batch)
        if st.unconsumed_credit >= self._half_window:
            self._grant()
        if self._on_item is not None:
            for item in batch:
                self._on_item(item)
        return batch

    async def aclose(self) -> None:
        """Stop listening; if the stream was still open, the server's context is killed."""
        if not self._st.done:
            self._conn.send_control(Kind.KILL, Control(self._st.request_id))
            self._st.terminate(errors.Cancelled("stream closed by the caller"))
        self._release()

    async def _wait_item(self) -> None:
        """Return once an item is queued; raise the stream's error or StopAsyncIteration."""
        while not self._st.items:
            st = self._st
            if st.done:
                error = st.error
                self._release_attempt()
                # No DATA frame arrived: nothing was delivered, so another instance may serve.
                if error is not None and st.expected_seq == 0 and self._reopen is not None:
                    again = await self._reopen(self, error)
                    if again is not None:
                        self._adopt(again)
                        continue
                self._release()
                if error is not None:
                    raise error
                raise StopAsyncIteration
            st.waiter.clear()
            if self._idle_timeout is None:
                await st.waiter.wait()
                continue
            try:
                # (asyncio.timeout, not wait_for: wait_for can swallow a cancellation that
                # comes just as the waiter is set.)
                async with asyncio.timeout(self._idle_timeout):
                    await st.waiter.wait()
            except TimeoutError:
                self._conn.send_control(Kind.KILL, Control(st.request_id))
                st.terminate(errors.ResponseTimeout(f"no response within {self._idle_timeout}s"))

    def _adopt(self, other: ResponseStream[T]) -> None:
        """Continue on ``other``'s attempt (same context; ``other`` is left empty)."""
        self._conn, self._st = other._conn, other._st
        self._half_window = other._half_window
        self._closed = False
        other._closed = True  # its attempt is this stream's now

    def _grant(self) -> None:
        """Tell the server the items consumed since the last grant may be replaced."""
        st = self._st
        if not st.done:
            self._conn.send_control(Kind.CREDIT, Credit(st.request_id, st.unconsumed_credit))
        st.unconsumed_credit = 0

    def _release_attempt(self) -> None:
        """Forget the current attempt on its connection."""
        if not self._closed:
            self._closed = True
            self._conn.forget_stream(self._st.request_id)

    def _release(self) -> None:
        self._release_attempt()
        on_release, self._on_release = self._on_release, None
        if on_release is not None:
            on_release()

    def __del__(self) -> None:
        # Dropped without being read to the end: the caller is gone, so is the request. Release
        # it even when its terminal already arrived, or the connection keeps it forever.
        if self._closed and self._on_release is None:
            return
        loop = self._loop
        try:
            here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is loop or not loop.is_running():
            self._drop()
        else:
            # Collected on another thread: the socket and the release callback belong to the
            # loop's thread (this resurrects the stream until the loop has run the drop).
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._drop)

    def _drop(self) -> None:
        with contextlib.suppress(Exception):
            if not self._closed and not self._st.done:
                self._conn.send_control(Kind.KILL, Control(self._st.request_id))
                self._st.terminate(None)
            self._release()
