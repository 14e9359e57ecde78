"""The server's writing side: what each open stream has to send, coalesced per peer and tick.

Each item a handler yields goes into its stream's buffer as it is and marks the stream dirty;
once per event-loop tick, ``Outbox`` sends every dirty stream's buffer (and terminal, when the
handler is done), all streams to one peer in one message: a DATA (or END/ERROR) frame when a
single stream has something, else a BATCH. The whole message is encoded in one call; if an item
cannot be encoded, the items before it still go out and its stream fails (``on_bad_item``).
Nothing waits to fill a batch: an idle stream's item goes out on the next tick alone, and only
what queued while a send could not proceed shares a frame. A full peer queue is retried every
2 ms; a peer that is gone is reported to the server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from .. import errors
from ..context import Context
from ..wire import Batch, Data, End, Error, Kind, encode, encode_item
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
        "failure",
        "finishing",
        "gone",
        "identity",
        "interrupted",
        "request_id",
        "room",
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
        #: Items the client accepts beyond those sent (its window, less what was sent, plus
        #: what it granted back); ``buf`` counts against it.
        self.credit = window
        #: Items the producer may append before it must call ``Outbox.make_room`` (which
        #: schedules the flush; ``wait_room`` when there is none); 1 after each send, so the
        #: next item schedules the next flush.
        self.room = 1
        #: Items yielded and not sent yet, as the handler made them (encoded when sent).
        self.buf: list[Any] = []
        self.seq = 0
        self.scheduled = False
        self.timed_out = False
        self.finishing = False
        self.gone = False
        #: The server cancelled the handler's task (kill grace over, deadline, shutdown): a
        #: CancelledError it ends with is not its own.
        self.interrupted = False
        #: Set when an item could not be encoded: the stream ends with this error.
        self.failure: errors.DynamoError | None = None
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
        on_bad_item: called with a stream and its ``failure`` set when one of its items could not
            be encoded (the server ends the handler; the stream's terminal becomes the failure).
    """

    def __init__(
        self,
        send: Callable[[bytes, bytes, bytes], int],
        on_gone: Callable[[bytes], None],
        is_open: Callable[[OpenStream], bool],
        on_bad_item: Callable[[OpenStream], None],
    ) -> None:
        self._send = send
        self._on_gone = on_gone
        self._is_open = is_open
        self._on_bad_item = on_bad_item
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

    def make_room(self, st: OpenStream) -> bool:
        """Called by the producer once ``st.room`` is spent: schedule the flush and, if the
        frame has room and the client credit, set ``st.room`` to what may be appended before
        the next call and return True; False means ``wait_room`` first (no coroutine is made
        on the common path, once per frame).

        A STOP lets the producer run once more so it can see ``is_stopped()`` and finish; one
        that keeps producing into a full buffer after that is killed. A killed stream (the
        server zeroes its credit) drops what its producer yields: False, and ``wait_room``
        only yields to the loop, so the producer runs on and can notice the kill.
        """
        pending = len(st.buf)
        if pending and not st.scheduled:  # ``schedule`` inline: the first item after a send
            st.scheduled = True
            self._dirty.append(st)
            if not self._flush_pending:
                self._flush_pending = True
                asyncio.get_running_loop().call_soon(self._flush)
        credit = st.credit
        room = (credit if credit < MAX_BATCH else MAX_BATCH) - pending
        if room > 0:
            # An empty buffer was just sent: its next item must schedule the next flush.
            st.room = room if pending else 1
            return True
        ctx = st.ctx
        if ctx.is_killed():
            st.buf.clear()
            st.room = 1
            return False
        if ctx.is_stopped():
            if pending > MAX_BATCH:
                ctx.kill()
            st.room = 1
            return True
        return False

    async def wait_room(self, st: OpenStream) -> None:
        """Wait until ``make_room`` succeeds (the buffer was sent, or credit came)."""
        while not self.make_room(st):
            if st.ctx.is_killed():  # abandoned: nothing to wait for (see make_room)
                await asyncio.sleep(0)
                return
            st.wake.clear()
            await st.wake.wait()

    async def finish(self, st: OpenStream, terminal: End | Error) -> None:
        """Queue the terminal after what is buffered and wait until both are sent (or the
        client is gone). A stream with a ``failure`` ends with that instead."""
        if st.failure is not None:
            terminal = _error(st, st.failure)
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
        try:
            kind, payload = self._message(streams)
        except Exception:  # an item msgspec cannot encode: find it, then send the rest
            for st in streams:
                self._drop_unencodable(st)
            kind, payload = self._message(streams)
        result = self._send(identity, kind, payload)
        if result == SendResult.SENT:
            for st in streams:
                if st.buf:
                    st.seq += 1
                    st.credit -= len(st.buf)
                    st.buf = []
                    st.room = 1
                st.terminal = None
                st.wake.set()
        return result

    def _message(self, streams: list[OpenStream]) -> tuple[bytes, bytes]:
        """The frame kind and encoded payload that carry ``streams``' buffers and terminals."""
        data: list[Data] = []
        ends: list[End] = []
        errs: list[Error] = []
        for st in streams:
            seq = st.seq
            if st.buf:
                data.append(Data(st.request_id, seq, st.buf))
                seq += 1
            terminal = st.terminal
            if terminal is not None:
                terminal.seq = seq
                if isinstance(terminal, End):
                    ends.append(terminal)
                else:
                    errs.append(terminal)
        if len(data) + len(ends) + len(errs) == 1:
            if data:
                return Kind.DATA, encode(data[0])
            if ends:
                return Kind.END, encode(ends[0])
            return Kind.ERROR, encode(errs[0])
        return Kind.BATCH, encode(Batch(data, ends, errs))

    def _drop_unencodable(self, st: OpenStream) -> None:
        """Cut ``st``'s buffer before its first item that does not encode and fail the stream."""
        for index, item in enumerate(st.buf):
            try:
                encode_item(item)
            except Exception as exc:
                st.buf = st.buf[:index]
                st.failure = errors.Unknown(f"{type(exc).__name__}: {exc}")
                if st.terminal is not None:
                    st.terminal = _error(st, st.failure)
                self._on_bad_item(st)
                return

    def _reschedule(self, streams: list[OpenStream]) -> None:
        for st in streams:
            if (st.buf or st.terminal is not None) and self._is_open(st):
                self.schedule(st)


def _error(st: OpenStream, error: errors.DynamoError) -> Error:
    return Error(st.request_id, 0, error.kind, error.message)
