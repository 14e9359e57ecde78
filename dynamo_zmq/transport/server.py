"""The serving side of the request plane: one ROUTER socket per process, many streams.

Each REQUEST starts a task that pulls items from the endpoint's async generator. Items go out in
DATA frames; items produced while earlier ones wait (same loop tick, a full peer queue, no
credit) are coalesced into one frame, so an idle stream adds no latency and a busy one sends
fewer, larger frames. A stream stops pulling from its generator when the client has not granted
credit for more items or when its buffer is full and cannot be sent: a slow reader slows the
producer instead of growing memory, and nothing is dropped. With auth on, callers' keys are
checked per request, and a revoked key's connections closed (``_callers.py``).
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
from ..resources import Resources, wait_event
from ..tracing import handled
from ..wire import (
    Control,
    Credit,
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
)
from ._bad_input import BadInput
from ._callers import Callers
from ._client_frames import DECODERS, request_id_of
from ._curve import current_curve
from ._ending import cancelled_terminal, on_deadline, on_kill, wire_text
from ._key_roles import Domain
from ._outbox import OpenStream, Outbox
from ._sockets import AsyncSocket, SendResult, make_socket

__all__ = ["Handler", "Server"]

log = logging.getLogger(__name__)

Handler = Callable[[msgspec.Raw, Context], AsyncIterator[Any]]
"""An endpoint as the transport sees it: raw request payload and context in, items out."""

#: A client that has sent nothing (not even a ping) for this long is gone: kill its streams.
CLIENT_TIMEOUT = 3.0
#: Largest request payload handed to a handler, in bytes; a bigger one is refused with
#: InvalidArgument before anything decodes it (a 1M-token prompt is ~5 MiB of MessagePack).
MAX_REQUEST_BYTES = 64 << 20
#: Seconds ``close`` gives cancelled streams to send their terminals.
CLOSE_GRACE = 2.0
#: Seconds a handler whose request was killed (its caller killed it, dropped its stream, or is
#: gone) has to notice (``is_stopped()`` / ``is_killed()`` between awaits, or its waiters) and
#: return before its task is cancelled. What it yields meanwhile is dropped.
KILL_GRACE = 1.0

class Server:
    """Binds the process's ROUTER socket and serves every registered endpoint on it.

    Args:
        resources: the owner of its tasks (a child is made for them) and of the ZMQ context.
        bind: ``tcp://host:port`` (port 0 picks a free one).
        instance_id: this process's instance id (reported in PONG/NOTICE).
        resolve: maps an endpoint path to its handler, or None if not served here.
        describe: builds the current ``Description``.
        callers: the key roles that may call an endpoint (auth on; default DEFAULT_CALLERS).
    """

    def __init__(
        self,
        resources: Resources,
        bind: str,
        instance_id: int,
        resolve: Callable[[str], Handler | None],
        describe: Callable[[], Description],
        callers: Callable[[str], frozenset[str]] | None = None,
    ) -> None:
        self._res = resources.child("server")
        self._admitted = callers
        self.callers: Callers | None = None  # auth on: the callers' keys
        self._bind = bind
        self.instance_id = instance_id
        self._resolve = resolve
        self._describe = describe
        self.rev = 0
        self.draining = False  # clients are told to route new work elsewhere
        self.refusing = False  # new requests are rejected with EngineShutdown
        self.max_request_bytes = MAX_REQUEST_BYTES
        self.kill_grace = KILL_GRACE
        self.address = ""
        self._sock: AsyncSocket | None = None
        self._streams: dict[tuple[bytes, int], OpenStream] = {}
        self._last_seen: dict[bytes, float] = {}
        self._outbox = Outbox(
            self._send_nowait, self._client_gone, self._is_open, self._on_bad_item
        )
        self._idle = asyncio.Event()
        self._idle.set()
        #: Malformed frames ("frame") and requests a handler refused as invalid ("request"):
        #: counted, and logged one line per kind per ``LOG_EVERY`` seconds.
        self.bad_input = BadInput(log)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> str:
        """Bind and start receiving; returns the bound ``tcp://host:port``."""
        # No ZMTP heartbeats: callers ping every 0.5 s and the reaper kills the streams of one
        # silent for CLIENT_TIMEOUT. A dead caller's connection is closed by the kernel's TCP
        # keepalive, which probes only a connection gone idle: nothing while callers ping (ZMTP
        # heartbeats cost every frontend's I/O thread two messages a second per worker).
        sock = make_socket(self._res.zctx, zmq.ROUTER, bind=self._bind, heartbeat_ms=0,
                           keepalive=True, zap_domain=Domain.REQUEST)
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = AsyncSocket(sock)
        if (curve := current_curve()) is not None:
            self.callers = Callers(curve, self._admitted)
            self._sock.senders = True
            self._res.on_close(self.callers.follow(self._client_gone))
        self._res.spawn(self._recv_loop(), "server-recv")
        self._res.spawn(self._reap_loop(), "server-reaper")
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

    def hand_over(self, reason: str) -> int:
        """End every running stream now with a retryable ``EngineShutdown(reason)``, after the
        items it already yielded, so its caller sends it elsewhere; refuses new requests. Each
        handler's context is killed (the engine aborts the request) and its task cancelled.
        Streams whose handler already returned end as they were going to. Returns how many
        were handed over; ``wait_idle`` tells when their terminals are out."""
        self.refuse_new()
        handed = 0
        for st in list(self._streams.values()):
            if st.finishing or st.ctx.is_killed() or st.failure is not None:
                continue
            st.failure = errors.EngineShutdown(reason)  # the terminal (see Outbox.finish)
            st.ctx.kill()  # a failure set: on_kill cancels the handler at once
            handed += 1
        return handed

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no stream is open; returns False on timeout."""
        return await wait_event(self._idle, timeout)

    async def close(self) -> None:
        """Cancel open streams (their clients see EngineShutdown; their terminals get up to
        ``CLOSE_GRACE`` seconds to go out), stop the loops, then close the socket."""
        streams = list(self._streams.values())
        tasks = []
        for st in streams:
            if st.task is not None and not st.task.done():
                st.interrupted = True
                st.task.cancel()
                tasks.append(st.task)
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_GRACE)
        for st in streams:  # a terminal still waiting for a full peer queue is abandoned
            st.gone = True
            st.wake.set()
        await self._res.close()
        if self._sock is not None:
            # Let ZMQ's I/O thread write the last frames (terminals of just-finished streams).
            self._sock.close(linger_ms=1000)

    # -- receiving -------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        await self._sock.drain_forever(self._dispatch, "a client")

    def _drain_pending(self) -> None:
        if self._sock is not None:
            self._sock.drain(self._dispatch, "a client")

    def _dispatch(self, frames: list[bytes]) -> None:
        identity = frames[0]
        self._last_seen[identity] = time.monotonic()
        if self.callers is not None and self._sock is not None:
            self.callers.note(identity, self._sock.sender)
        if len(frames) != 3:
            self._malformed(
                identity, f"expected 2 frames after the identity, got {len(frames) - 1}"
            )
            return
        kind, payload = frames[1], frames[2]
        decoder = DECODERS.get(kind)
        if decoder is None:
            self._malformed(identity, f"unknown frame kind {kind!r}")
            return
        try:
            msg = decoder.decode(payload)
        # Deep nesting raises RecursionError, a str field of invalid UTF-8 UnicodeDecodeError.
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
            self._malformed(identity, f"bad {kind!r} payload: {exc}", request_id_of(payload))
            return
        # the frame's kind chose the decoder, so the decoded type tells the kind
        if isinstance(msg, Request):
            self._on_request(identity, msg)
        elif isinstance(msg, Ping):
            pong = Pong(msg.nonce, self.instance_id, self.rev, self.draining, len(self._streams))
            self._send_nowait(identity, Kind.PONG, encode(pong))
        elif isinstance(msg, Credit):
            st = self._streams.get((identity, msg.request_id))
            if st is not None and msg.items > 0 and not st.ctx.is_killed():
                st.credit += msg.items
                st.wake.set()
        elif isinstance(msg, Control):  # STOP or KILL
            st = self._streams.get((identity, msg.request_id))
            if st is None:
                log.debug("%r for unknown request %d", kind, msg.request_id)
            elif kind == Kind.KILL:
                st.ctx.kill()
            else:
                st.ctx.stop()
        elif isinstance(msg, Describe):
            self._send_nowait(identity, Kind.INFO, encode(self._describe()))

    @property
    def malformed_frames(self) -> int:
        """Frames refused as malformed so far."""
        return self.bad_input.counts.get("frame", 0)

    def _malformed(self, identity: bytes, reason: str, request_id: int = 0) -> None:
        self.bad_input.note("frame", "malformed frame from peer %s: %s", identity.hex(), reason)
        if request_id and (identity, request_id) in self._streams:
            request_id = 0  # never inject a second terminal into a live stream
        err = Error(request_id, 0, errors.InvalidArgument.kind, f"malformed frame: {reason}")
        self._send_nowait(identity, Kind.ERROR, encode(err))

    def _on_request(self, identity: bytes, req: Request) -> None:
        key = (identity, req.request_id)

        def reject(exc: errors.DynamoError, request_id: int = req.request_id) -> None:
            if isinstance(exc, errors.InvalidArgument):
                self.bad_input.note("request", "request %d from peer %s refused: %s",
                                    req.request_id, identity.hex(), exc.message)
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
        if self.callers is not None and (why := self.callers.deny(identity, req.endpoint)):
            reject(errors.PermissionDenied(why))
            return
        if req.window <= 0:
            reject(errors.InvalidArgument("window must be positive"))
            return
        if len(req.payload) > self.max_request_bytes:
            reject(errors.InvalidArgument(
                f"request payload of {len(req.payload)} bytes is over the "
                f"{self.max_request_bytes}-byte limit"))
            return
        st = OpenStream(identity, req.request_id, Context(req.context_id), req.window)
        self._streams[key] = st
        self._idle.clear()
        run = handled(self._run_stream(st, handler, req.payload), req.trace, req.endpoint,
                      req.context_id)
        st.task = self._res.spawn(run, f"stream-{req.request_id}")
        # Also when the task is cancelled before it ever ran (its body's finally never runs).
        st.task.add_done_callback(lambda _t: self._forget(st))
        grace = self.kill_grace
        st.ctx.add_listener(lambda killed: on_kill(st, grace) if killed else st.wake.set())
        if req.timeout is not None and 0 < req.timeout < 1e9:
            timer = asyncio.get_running_loop().call_later(req.timeout, on_deadline, st)
            st.task.add_done_callback(lambda _t: timer.cancel())

    # -- streaming -------------------------------------------------------------------------

    async def _run_stream(self, st: OpenStream, handler: Handler, payload: msgspec.Raw) -> None:
        terminal: End | Error
        agen: AsyncIterator[Any] | None = None
        try:
            agen = handler(payload, st.ctx)
            outbox = self._outbox
            async for item in agen:
                st.buf.append(item)  # encoded with the rest of its frame when sent
                st.room -= 1
                # The first item since a send, a full frame, or no credit:
                if st.room <= 0 and not outbox.make_room(st):
                    await outbox.wait_room(st)
            # An abandoned stream never ends as complete, however its handler returned.
            terminal = cancelled_terminal(st) if st.ctx.is_killed() else End(st.request_id, 0)
        except asyncio.CancelledError:
            terminal = cancelled_terminal(st)
        except Exception as exc:
            err = errors.from_exception(exc)
            if isinstance(err, errors.Unknown):
                log.exception("handler for request %d failed", st.request_id)
            elif isinstance(err, errors.InvalidArgument):
                self.bad_input.note("request", "request %d from peer %s refused: %s",
                                    st.request_id, st.identity.hex(), err.message)
            terminal = Error(st.request_id, 0, err.kind, wire_text(err.message))
        finally:
            st.finishing = True  # from here on a KILL no longer cancels this task
            aclose = getattr(agen, "aclose", None)
            if aclose is not None:
                # Whatever the handler's clean-up raises, the terminal must still go out.
                with contextlib.suppress(BaseException):
                    await aclose()
        await self._outbox.finish(st, terminal)

    def _on_bad_item(self, st: OpenStream) -> None:
        """One of ``st``'s items could not be encoded: a bug in the handler, like raising."""
        log.error("handler for request %d yielded an item that cannot be encoded: %s",
                  st.request_id, st.failure)
        st.ctx.kill()  # ends the handler at once; its terminal is the failure

    def _is_open(self, st: OpenStream) -> bool:
        return (st.identity, st.request_id) in self._streams

    def _forget(self, st: OpenStream) -> None:
        if self._streams.get((st.identity, st.request_id)) is st:
            del self._streams[(st.identity, st.request_id)]
        if not self._streams:
            self._idle.set()

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
        if self.callers is not None:
            self.callers.prune(self._last_seen)
