"""Response streams on the calling side: one request's items as they arrive, decoded once.

``ResponseStream`` is what a ``PeerConnection`` returns for one request. Each DATA frame's items
are decoded in one call, as they arrive, by the decoder given when the request was sent
(``_items.py``), so a caller that knows the item type gets validated objects and nothing
decodes twice. ``ItemStream`` is the interface every stream of items implements (this one, and
the runtime's retrying stream on top of it).
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Generic, TypeVar

from .. import errors
from ..context import Context
from ..wire import Control, Credit, Kind
from ._items import ItemDecoder
from ._stream_protocols import MAX_BATCH_ITEMS, ItemStream, StreamHost

__all__ = ["ItemStream", "Reopen", "ResponseStream", "StreamHost"]

T = TypeVar("T")



class _StreamState:
    """What the connection knows of one open request (it fills ``items``; the stream drains)."""

    __slots__ = (
        "decode",
        "done",
        "endpoint",
        "error",
        "expected_seq",
        "items",
        "request_id",
        "unconsumed_credit",
        "unlink",
        "waiter",
        "window",
    )

    def __init__(self, request_id: int, window: int, decode: ItemDecoder[Any],
                 endpoint: str = "") -> None:
        self.request_id = request_id
        self.endpoint = endpoint
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


#: Seconds early a timer may fire (the loop runs handles due within its clock's resolution).
_EARLY = 1e-3


def _check_wait(ref: weakref.ref[ResponseStream[Any]]) -> None:
    """A stream's bounds timer (a weak reference: an armed timer never keeps a dropped stream
    alive)."""
    stream = ref()
    if stream is not None:
        stream._check_wait()


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

    Two bounds on a wait for the next item, both off by default: the idle timeout (KILL, then
    ``ResponseTimeout``), and the stall timeout (``set_stall_timeout``: KILL, then the
    retryable ``StreamStalled``). A stall is judged only on a stream that has had an item, or
    whose instance no longer offers its endpoint (a worker whose health check fails): waiting
    for the first item on a healthy instance is a long prompt's prefill or a queue, not a
    stall. The stall timeout outlives failover (it is the stream's, not the attempt's).
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
        self._stall: float | None = None
        self._closed = False
        self._half_window = max(1, state.window // 2)
        self._reopen: Reopen[T] | None = None
        self._on_item: Callable[[T], object] | None = None
        self._on_release: Callable[[], object] | None = None
        self._loop = asyncio.get_running_loop()
        #: The bounds' timer (``_arm``) and when the reader's current wait began (None: it
        #: is not waiting).
        self._timer: asyncio.TimerHandle | None = None
        self._waiting_since: float | None = None

    def set_reopen(self, reopen: Reopen[T] | None) -> None:
        """What to do when the stream fails before its first item (see the class docstring)."""
        self._reopen = reopen

    def set_on_item(self, on_item: Callable[[T], object] | None) -> None:
        """Called with each item as the caller gets it (see the class docstring)."""
        self._on_item = on_item

    def set_on_release(self, on_release: Callable[[], object] | None) -> None:
        """Called once when the stream is released (see the class docstring)."""
        self._on_release = on_release

    def set_stall_timeout(self, seconds: float | None) -> None:
        """Seconds without an item after which the stream is lost (see the class docstring);
        None: never."""
        self._stall = seconds
        self._disarm()  # the next wait arms the timer with the new bound

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
            if self._idle_timeout is None and self._stall is None:
                await st.waiter.wait()
            else:
                await self._wait_bounded(st)

    async def _wait_bounded(self, st: _StreamState) -> None:
        """Wait for ``st`` to change within the idle and stall timeouts; past either, the
        stream's timer ends it (``_check_wait``). The timer is armed once and moved on lazily
        when it fires, so a wait that ends in time costs no timer work (most waits do)."""
        since = self._waiting_since = self._loop.time()
        if self._timer is None:
            self._arm(since, since)
        try:
            await st.waiter.wait()
        finally:
            self._waiting_since = None

    def _arm(self, since: float, now: float) -> None:
        """Check the wait that began at ``since`` at its next bound after ``now``."""
        idle, stall = self._idle_timeout, self._stall
        due = []
        if idle is not None:
            due.append(since + idle)
        if stall is not None:
            # Past the stall bound on a stream still waiting for its first item from a healthy
            # instance: not a stall (see the class docstring); look again a stall later.
            due.append(since + stall if now < since + stall - _EARLY else now + stall)
        if due:
            self._timer = self._loop.call_at(min(due), _check_wait, weakref.ref(self))

    def _disarm(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def _check_wait(self) -> None:
        """The timer: end the stream if its reader has waited past a bound, else re-arm."""
        self._timer = None
        st, since = self._st, self._waiting_since
        if st.done or since is None:  # ended, or not waiting: the next wait arms it again
            return
        now = self._loop.time()
        waited = now + _EARLY - since
        idle, stall = self._idle_timeout, self._stall
        error: errors.DynamoError
        if idle is not None and waited >= idle:
            error = errors.ResponseTimeout(f"no response within {idle}s")
        elif (stall is not None and waited >= stall
              and not (st.expected_seq == 0 and self._conn.serves(st.endpoint))):
            error = errors.StreamStalled(f"nothing arrived for {stall:g}s")
        else:
            self._arm(since, now)
            return
        self._conn.send_control(Kind.KILL, Control(st.request_id))
        st.terminate(error)

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
        self._disarm()
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
