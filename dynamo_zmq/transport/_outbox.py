"""The server's writing side: what each open stream has to send, coalesced per peer and tick.

Each item a handler yields goes into its stream's buffer and marks the stream dirty; once per
event-loop tick, ``Outbox`` sends every dirty stream's buffer (and terminal, when the handler is
done), all streams to one peer in one message: a DATA (or END/ERROR) frame when a single stream
has something, else a BATCH. Nothing waits to fill a batch: an idle stream's item goes out on the
next tick alone, and only what queued while a send could not proceed shares a frame. A full peer
queue is retried every 2 ms; a peer that is gone is reported to the server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec

from ..context import Context
from ..wire import Batch, Data, End, Error, Kind, encode
from ._sockets import SendResult

__all__ = ["MAX_BATCH", "OpenStream", "Outbox"]

#: Most items one DATA frame carries; also how far a producer may run ahead of the socket.
MAX_BATCH = 256
#: Seconds before a stream whose peer's queue was full is tried again.
RETRY_FULL = 0.002


class OpenStream:
    """Server-side state of one open request."""

    __slots__ = (
        "buf",
        "credit",
        "ctx",
        "finishing",
        "gone",
        "identity",
        "request_id",
        "scheduled",
        "seq",
        "task",
        "terminal",
        "timed_out",
        "wake",
    )

    def __init__(self, identity: bytes, request_id: int, ctx: Context, window: int) -> None:
        self.identity = identity
        self.request_id = request_id
        self.ctx = ctx
        self.credit = window
        self.buf: list[msgspec.Raw] = []
        self.seq = 0
        self.scheduled = False
        self.timed_out = False
        self.finishing = False
        self.gone = False
        #: The END or ERROR waiting to go out after ``buf`` (set when the handler is done).
        self.terminal: End | Error | None = None
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None


class Outbox:
    """Sends what open streams buffered, coalesced per peer, once per loop tick.

    Args:
        send: sends ``(identity, kind, payload)`` without blocking; returns a ``SendResult``.
        on_gone: called with a peer's identity when a send finds it gone.
        is_open: whether a stream is still open (a blocked stream is retried only if it is).
    """

    def __init__(
        self,
        send: Callable[[bytes, bytes, bytes], int],
        on_gone: Callable[[bytes], None],
        is_open: Callable[[OpenStream], bool],
    ) -> None:
        self._send = send
        self._on_gone = on_gone
        self._is_open = is_open
        self._dirty: list[OpenStream] = []
        self._flush_pending = False

    def schedule(self, st: OpenStream) -> None:
        """Mark ``st`` as having something to send; a flush runs on the next loop tick."""
        if not st.scheduled:
            st.scheduled = True
            self._dirty.append(st)
            if not self._flush_pending:
                self._flush_pending = True
                asyncio.get_running_loop().call_soon(self._flush)

    async def wait_room(self, st: OpenStream) -> None:
        """Block the producer until the buffer is sent and the client granted credit.

        A STOP lets the producer run once more so it can see ``is_stopped()`` and finish; one
        that keeps producing into a full buffer after that is killed.
        """
        while (st.credit <= 0 or st.buf) and not st.ctx.is_stopped():
            st.wake.clear()
            await st.wake.wait()
        if st.ctx.is_stopped() and len(st.buf) > MAX_BATCH:
            st.ctx.kill()

    async def finish(self, st: OpenStream, terminal: End | Error) -> None:
        """Queue the terminal after what is buffered and wait until both are sent (or the
        client is gone)."""
        st.terminal = terminal
        self.schedule(st)
        while st.terminal is not None and not st.gone:
            st.wake.clear()
            await st.wake.wait()

    def _flush(self) -> None:
        self._flush_pending = False
        dirty, self._dirty = self._dirty, []
        by_peer: dict[bytes, list[OpenStream]] = {}
        for st in dirty:
            st.scheduled = False
            if st.buf or st.terminal is not None:
                by_peer.setdefault(st.identity, []).append(st)
        blocked: list[OpenStream] = []
        for identity, streams in by_peer.items():
            result = self._send_to_peer(identity, streams)
            if result == SendResult.FULL:
                blocked.extend(streams)
            elif result == SendResult.GONE:
                self._on_gone(identity)
        if blocked:
            asyncio.get_running_loop().call_later(RETRY_FULL, self._reschedule, blocked)

    def _send_to_peer(self, identity: bytes, streams: list[OpenStream]) -> int:
        data: list[Data] = []
        ends: list[End] = []
        errs: list[Error] = []
        for st in streams:
            seq = st.seq
            if st.buf:
                data.append(Data(st.request_id, seq, st.buf))
                seq += 1
            if st.terminal is not None:
                st.terminal.seq = seq
                (ends if isinstance(st.terminal, End) else errs).append(st.terminal)
        if len(data) + len(ends) + len(errs) == 1:
            if data:
                result = self._send(identity, Kind.DATA, encode(data[0]))
            elif ends:
                result = self._send(identity, Kind.END, encode(ends[0]))
            else:
                result = self._send(identity, Kind.ERROR, encode(errs[0]))
        else:
            result = self._send(identity, Kind.BATCH, encode(Batch(data, ends, errs)))
        if result == SendResult.SENT:
            for st in streams:
                if st.buf:
                    st.seq += 1
                    st.buf = []
                st.terminal = None
                st.wake.set()
        return result

    def _reschedule(self, streams: list[OpenStream]) -> None:
        for st in streams:
            if (st.buf or st.terminal is not None) and self._is_open(st):
                self.schedule(st)
