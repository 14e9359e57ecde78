"""The serving side of the request plane: one ROUTER socket per process, many streams.

Each REQUEST starts a task that pulls items from the endpoint's async generator. Items go out in
DATA frames; items produced while earlier ones wait (same loop tick, a full peer queue, no
credit) are coalesced into one frame, so an idle stream adds no latency and a busy one sends
fewer, larger frames. A stream stops pulling from its generator when the client has not granted
credit for more items or when its buffer is full and cannot be sent: a slow reader slows the
producer instead of growing memory, and nothing is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import zmq

from .. import errors
from ..context import Context
from ..wire import (
    Batch,
    Control,
    Credit,
    Data,
    Describe,
    Description,
    End,
    Error,
    Kind,
    Notice,
    Ping,
    Pong,
    Request,
    encode,
    encode_item,
)
from ._sockets import AsyncSocket, SendResult, make_socket

__all__ = ["Handler", "Server"]

log = logging.getLogger(__name__)

Handler = Callable[[msgspec.Raw, Context], AsyncIterator[Any]]
"""An endpoint as the transport sees it: raw request payload and context in, items out."""

#: Most items one DATA frame carries; also how far a producer may run ahead of the socket.
MAX_BATCH = 256
#: A client that has sent nothing (not even a ping) for this long is gone: kill its streams.
CLIENT_TIMEOUT = 3.0
#: Largest request payload handed to a handler, in bytes; a bigger one is refused with
#: InvalidArgument before anything decodes it (a 1M-token prompt is ~5 MiB of MessagePack).
MAX_REQUEST_BYTES = 64 << 20

_decoders = {
    Kind.REQUEST: msgspec.msgpack.Decoder(Request),
    Kind.STOP: msgspec.msgpack.Decoder(Control),
    Kind.KILL: msgspec.msgpack.Decoder(Control),
    Kind.CREDIT: msgspec.msgpack.Decoder(Credit),
    Kind.PING: msgspec.msgpack.Decoder(Ping),
    Kind.DESCRIBE: msgspec.msgpack.Decoder(Describe),
}


class _Stream:
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


class Server:
    """Binds the process's ROUTER socket and serves every registered endpoint on it.

    Args:
        zctx: the process's ZMQ context.
        bind: ``tcp://host:port`` (port 0 picks a free one).
        instance_id: this process's instance id (reported in PONG/NOTICE).
        resolve: maps an endpoint path to its handler, or None if not served here.
        describe: builds the current ``Description``.
    """

    def __init__(
        self,
        zctx: zmq.Context,
        bind: str,
        instance_id: int,
        resolve: Callable[[str], Handler | None],
        describe: Callable[[], Description],
    ) -> None:
        self._zctx = zctx
        self._bind = bind
        self.instance_id = instance_id
        self._resolve = resolve
        self._describe = describe
        self.rev = 0
        self.draining = False  # clients are told to route new work elsewhere
        self.refusing = False  # new requests are rejected with EngineShutdown
        self.max_request_bytes = MAX_REQUEST_BYTES
        self.address = ""
        self._sock: AsyncSocket | None = None
        self._streams: dict[tuple[bytes, int], _Stream] = {}
        self._last_seen: dict[bytes, float] = {}
        self._dirty: list[_Stream] = []
        self._flush_pending = False
        self._tasks: list[asyncio.Task[None]] = []
        self._idle = asyncio.Event()
        self._idle.set()
        self.malformed_frames = 0

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> str:
        """Bind and start receiving; returns the bound ``tcp://host:port``."""
        sock = make_socket(self._zctx, zmq.ROUTER, bind=self._bind)
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = AsyncSocket(sock)
        self._tasks = [
            asyncio.create_task(self._recv_loop(), name="server-recv"),
            asyncio.create_task(self._reap_loop(), name="server-reaper"),
        ]
        return self.address

    @property
    def inflight(self) -> int:
        return len(self._streams)

    def bump_rev(self) -> None:
        """The description changed (endpoint added/removed): tell connected clients."""
        self.rev += 1
        self._broadcast_notice()

    def set_draining(self) -> None:
        """Tell connected clients to send new work elsewhere (requests are still admitted)."""
        if not self.draining:
            self.draining = True
            self._broadcast_notice()

    def refuse_new(self) -> None:
        """Reject every new request with EngineShutdown from now on."""
        self.set_draining()
        self.refusing = True

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no stream is open; returns False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def close(self) -> None:
        """Kill open streams (their clients see EngineShutdown), then close the socket."""
        for st in list(self._streams.values()):
            if st.task is not None:
                st.task.cancel()
        stream_tasks = [st.task for st in self._streams.values() if st.task is not None]
        if stream_tasks:
            await asyncio.wait(stream_tasks, timeout=2.0)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        self._tasks = []
        if self._sock is not None:
            # Let ZMQ's I/O thread write the last frames (terminals of just-finished streams).
            self._sock.close(linger_ms=1000)

    # -- receiving -------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        sock = self._sock
        assert sock is not None
        while not sock.closed:
            self._drain_pending()
            await sock.wait_readable()

    def _drain_pending(self) -> None:
        sock = self._sock
        if sock is None or sock.closed:
            return
        while (frames := sock.recv_nowait()) is not None:
            try:
                self._dispatch(frames)
            except Exception:  # a bug, not bad input: log it and keep serving
                log.exception("error dispatching frame")

    def _dispatch(self, frames: list[bytes]) -> None:
        identity = frames[0]
        self._last_seen[identity] = time.monotonic()
        if len(frames) != 3:
            self._malformed(identity, f"expected 2 frames after the identity, got {len(frames) - 1}")
            return
        kind, payload = frames[1], frames[2]
        decoder = _decoders.get(kind)
        if decoder is None:
            self._malformed(identity, f"unknown frame kind {kind!r}")
            return
        try:
            msg = decoder.decode(payload)
        except (msgspec.DecodeError, RecursionError) as exc:  # deep nesting raises RecursionError
            self._malformed(identity, f"bad {kind!r} payload: {exc}", _request_id_of(payload))
            return
        if kind == Kind.REQUEST:
            self._on_request(identity, msg)
        elif kind == Kind.PING:
            pong = Pong(msg.nonce, self.instance_id, self.rev, self.draining, len(self._streams))
            self._send_nowait(identity, Kind.PONG, encode(pong))
        elif kind == Kind.CREDIT:
            st = self._streams.get((identity, msg.request_id))
            if st is not None and msg.items > 0:
                st.credit += msg.items
                st.wake.set()
        elif kind == Kind.STOP or kind == Kind.KILL:
            st = self._streams.get((identity, msg.request_id))
            if st is None:
                log.debug("%r for unknown request %d", kind, msg.request_id)
            elif kind == Kind.KILL:
                st.ctx.kill()
            else:
                st.ctx.stop()
        elif kind == Kind.DESCRIBE:
            self._send_nowait(identity, Kind.INFO, encode(self._describe()))

    def _malformed(self, identity: bytes, reason: str, request_id: int = 0) -> None:
        self.malformed_frames += 1
        log.warning("malformed frame from peer %s: %s", identity.hex(), reason)
        if request_id and (identity, request_id) in self._streams:
            request_id = 0  # never inject a second terminal into a live stream
        err = Error(request_id, 0, errors.InvalidArgument.kind, f"malformed frame: {reason}")
        self._send_nowait(identity, Kind.ERROR, encode(err))

    def _on_request(self, identity: bytes, req: Request) -> None:
        key = (identity, req.request_id)

        def reject(exc: errors.DynamoError, request_id: int = req.request_id) -> None:
            err = Error(request_id, 0, exc.kind, exc.message)
            self._send_nowait(identity, Kind.ERROR, encode(err))

        if req.request_id <= 0:
            reject(errors.InvalidArgument("request id must be positive"))
            return
        if key in self._streams:
            # Request 0: never inject a second terminal into the live stream with that id.
            reject(errors.InvalidArgument(f"request id {req.request_id} is already open"), 0)
            return
        if self.refusing:
            reject(errors.EngineShutdown(f"instance {self.instance_id:x} is shutting down"))
            return
        handler = self._resolve(req.endpoint)
        if handler is None:
            reject(errors.InvalidArgument(f"endpoint {req.endpoint!r} is not served here"))
            return
        if req.window <= 0:
            reject(errors.InvalidArgument("window must be positive"))
            return
        if len(req.payload) > self.max_request_bytes:
            reject(errors.InvalidArgument(
                f"request payload of {len(req.payload)} bytes is over the {self.max_request_bytes}-byte limit"))
            return
        st = _Stream(identity, req.request_id, Context(req.context_id), req.window)
        self._streams[key] = st
        self._idle.clear()
        st.task = asyncio.create_task(
            self._run_stream(st, handler, req.payload), name=f"stream-{req.request_id}"
        )
        # Also when the task is cancelled before it ever ran (its body's finally never runs).
        st.task.add_done_callback(lambda _t: self._forget(st))
        st.ctx.add_listener(lambda killed: _on_kill(st) if killed else st.wake.set())
        if req.timeout is not None and 0 < req.timeout < 1e9:
            timer = asyncio.get_running_loop().call_later(req.timeout, _on_deadline, st)
            st.task.add_done_callback(lambda _t: timer.cancel())

    # -- streaming -------------------------------------------------------------------------

    async def _run_stream(self, st: _Stream, handler: Handler, payload: msgspec.Raw) -> None:
        terminal: tuple[bytes, Any]
        agen: AsyncIterator[Any] | None = None
        try:
            agen = handler(payload, st.ctx)
            async for item in agen:
                st.buf.append(encode_item(item))
                st.credit -= 1
                self._schedule(st)
                if st.credit <= 0 or len(st.buf) >= MAX_BATCH:
                    await self._wait_room(st)
                if st.ctx.is_killed():
                    raise asyncio.CancelledError
            terminal = (Kind.END, End(st.request_id, 0))
        except asyncio.CancelledError:
            exc: errors.DynamoError
            if st.timed_out:
                exc = errors.ResponseTimeout("request deadline exceeded")
            elif st.ctx.is_killed():
                exc = errors.Cancelled("request killed")
            else:
                exc = errors.EngineShutdown("server closed")
            terminal = (Kind.ERROR, Error(st.request_id, 0, exc.kind, exc.message))
        except Exception as exc:
            err = errors.from_exception(exc)
            if isinstance(err, errors.Unknown):
                log.exception("handler for request %d failed", st.request_id)
            terminal = (Kind.ERROR, Error(st.request_id, 0, err.kind, _wire_text(err.message)))
        finally:
            aclose = getattr(agen, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(BaseException):
                    await aclose()
        st.finishing = True
        await self._finish(st, *terminal)

    def _forget(self, st: _Stream) -> None:
        if self._streams.get((st.identity, st.request_id)) is st:
            del self._streams[(st.identity, st.request_id)]
        if not self._streams:
            self._idle.set()

    async def _wait_room(self, st: _Stream) -> None:
        """Block the producer until the buffer is sent and the client granted credit.

        A STOP lets the producer run once more so it can see ``is_stopped()`` and finish; one
        that keeps producing into a full buffer after that is killed.
        """
        while (st.credit <= 0 or st.buf) and not st.ctx.is_stopped():
            st.wake.clear()
            await st.wake.wait()
        if st.ctx.is_stopped() and len(st.buf) > MAX_BATCH:
            st.ctx.kill()

    def _schedule(self, st: _Stream) -> None:
        if not st.scheduled:
            st.scheduled = True
            self._dirty.append(st)
            if not self._flush_pending:
                self._flush_pending = True
                asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Send what every dirty stream has buffered (runs once per loop tick).

        All streams to one peer go out in one message: a DATA (or END/ERROR) frame when a single
        stream has something, else a BATCH of every stream's DATA, END and ERROR. With many
        concurrent streams this turns one ZMQ send per token per stream into one per tick.
        """
        self._flush_pending = False
        dirty, self._dirty = self._dirty, []
        by_peer: dict[bytes, list[_Stream]] = {}
        for st in dirty:
            st.scheduled = False
            if st.buf or st.terminal is not None:
                by_peer.setdefault(st.identity, []).append(st)
        blocked: list[_Stream] = []
        for identity, streams in by_peer.items():
            result = self._send_to_peer(identity, streams)
            if result == SendResult.FULL:
                blocked.extend(streams)
            elif result == SendResult.GONE:
                self._client_gone(identity)
        if blocked:
            asyncio.get_running_loop().call_later(0.002, self._reschedule, blocked)

    def _send_to_peer(self, identity: bytes, streams: list[_Stream]) -> int:
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
            kind, msg = (Kind.DATA, data[0]) if data else (Kind.END, ends[0]) if ends else (Kind.ERROR, errs[0])
            result = self._send_nowait(identity, kind, encode(msg))
        else:
            result = self._send_nowait(identity, Kind.BATCH, encode(Batch(data, ends, errs)))
        if result == SendResult.SENT:
            for st in streams:
                if st.buf:
                    st.seq += 1
                    st.buf = []
                st.terminal = None
                st.wake.set()
        return result

    def _reschedule(self, streams: list[_Stream]) -> None:
        for st in streams:
            if (st.buf or st.terminal is not None) and (st.identity, st.request_id) in self._streams:
                self._schedule(st)

    async def _finish(self, st: _Stream, kind: bytes, terminal: Any) -> None:
        """Queue the terminal after what is buffered and wait until both are sent (or the
        client is gone)."""
        st.terminal = terminal
        self._schedule(st)
        while st.terminal is not None and not st.gone:
            st.wake.clear()
            await st.wake.wait()

    def _send_nowait(self, identity: bytes, kind: bytes, payload: bytes) -> int:
        if self._sock is None or self._sock.closed:
            return SendResult.GONE
        return self._sock.try_send([identity, kind, payload])

    def _broadcast_notice(self) -> None:
        payload = encode(Notice(self.instance_id, self.rev, self.draining))
        for identity in list(self._last_seen):
            self._send_nowait(identity, Kind.NOTICE, payload)

    # -- client liveness -------------------------------------------------------------------

    def _client_gone(self, identity: bytes) -> None:
        self._last_seen.pop(identity, None)
        orphans = [st for (ident, _), st in self._streams.items() if ident == identity]
        if orphans:
            log.info("client %s is gone: killing its %d open streams", identity.hex(), len(orphans))
        for st in orphans:
            st.gone = True
            st.wake.set()
            st.ctx.kill()

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(CLIENT_TIMEOUT / 3)
            self._reap()

    def _reap(self) -> None:
        """Forget clients silent for ``CLIENT_TIMEOUT`` (their streams are killed)."""
        # After a stall of this process the reaper can run before the receive loop: read what
        # already arrived first, so a client is never reaped for our own silence.
        self._drain_pending()
        cutoff = time.monotonic() - CLIENT_TIMEOUT
        for identity, seen in list(self._last_seen.items()):
            if seen < cutoff:
                self._client_gone(identity)


def _on_kill(st: _Stream) -> None:
    st.wake.set()
    if st.task is not None and not st.task.done() and not st.finishing:
        st.task.cancel()


def _on_deadline(st: _Stream) -> None:
    if st.task is not None and not st.task.done():
        st.timed_out = True
        st.ctx.kill()


def _wire_text(text: object) -> str:
    """``text`` as a str MessagePack can carry.

    A handler's message may hold lone surrogates (text decoded with ``surrogateescape``), which
    make the terminal unencodable: the client would wait forever. Escape them instead.
    """
    return str(text).encode("utf-8", "backslashreplace").decode("utf-8")


def _request_id_of(payload: bytes) -> int:
    """Best effort: the first element of an array-like payload, if it is a positive int."""
    try:
        value = msgspec.msgpack.decode(payload)
    except Exception:
        return 0
    # type() rather than isinstance(): a bool is not an id (and would encode as true, not an int).
    if isinstance(value, list) and value and type(value[0]) is int and value[0] > 0:
        return value[0]
    return 0
