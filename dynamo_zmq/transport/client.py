"""The calling side of the request plane: one DEALER connection per remote process.

A ``PeerConnection`` connects to one address, learns who is there (DESCRIBE), checks that it
is alive (monitor events, pings: ``_peer_liveness.py``), and multiplexes any number of response
streams over the socket. A lost peer's open streams end with ``Disconnected``, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from typing import TypeVar

import msgspec
import zmq

from .. import errors
from ..context import Context
from ..resources import Resources, wait_event
from ..tracing import outgoing
from ..wire import (
    PROTOCOL_VERSION,
    Control,
    Description,
    End,
    Error,
    Kind,
    Notice,
    Pong,
    RawBatch,
    RawData,
    Request,
    encode,
)
from ._curve import current_curve
from ._items import ItemDecoder, decode_items
from ._peer_liveness import HANDSHAKE_FAILED, PING_INTERVAL, PeerLiveness, PeerState, PingTicker
from ._sockets import AsyncSocket, SendResult, make_socket
from ._streams import ResponseStream, _StreamState

__all__ = ["DEFAULT_WINDOW", "PeerConnection", "PeerState"]

log = logging.getLogger(__name__)

_FromServer = RawData | End | Error | Pong | Description | Notice | RawBatch
"""What a server sends; each frame kind decodes to its own one of these types."""

_decoders: dict[bytes, msgspec.msgpack.Decoder[_FromServer]] = {
    Kind.DATA: msgspec.msgpack.Decoder(RawData),
    Kind.END: msgspec.msgpack.Decoder(End),
    Kind.ERROR: msgspec.msgpack.Decoder(Error),
    Kind.PONG: msgspec.msgpack.Decoder(Pong),
    Kind.INFO: msgspec.msgpack.Decoder(Description),
    Kind.NOTICE: msgspec.msgpack.Decoder(Notice),
    Kind.BATCH: msgspec.msgpack.Decoder(RawBatch),
}

T = TypeVar("T")

_request_ids = itertools.count(1)

#: Items a server may send on a stream before the caller grants more credit.
DEFAULT_WINDOW = 1024


class PeerConnection:
    """A DEALER connection to one serving process, with liveness and stream multiplexing.

    Args:
        resources: the owner of its tasks (a child is made for them) and of the ZMQ context.
        address: ``tcp://host:port`` of the peer's ROUTER socket.
        on_change: called (synchronously) whenever state, description or draining changes.
        server_key: the peer's advertised CURVE public key (Z85); with auth on, the connection
            is made only with it and only if it is authorized (``CurveRefused`` from start).
        ping_interval: seconds between application pings (a ``ticker``'s interval when it
            has one).
        liveness_timeout: a READY peer silent for this long is marked DOWN (one that leaves a
            ping unanswered for ``ANSWER_TIMEOUT`` is out of routing before that: SILENT).
        ticker: the pool's shared pinger (``PingTicker``); None: a ping task of its own.
    """

    def __init__(
        self,
        resources: Resources,
        address: str,
        on_change: Callable[[PeerConnection], None] | None = None,
        ping_interval: float = PING_INTERVAL,
        liveness_timeout: float = 1.5,
        *,
        server_key: bytes | None = None,
        ticker: PingTicker | None = None,
    ) -> None:
        self._res = resources.child(f"peer {address}")
        self.address = address
        self.server_key = server_key
        self._on_change = on_change
        self._ticker = ticker
        self.state = PeerState.CONNECTING
        self.description: Description | None = None
        self.draining = False
        self.inflight = 0
        #: Messages received from the peer (for tests and debugging).
        self.frames_received = 0
        self._sock: AsyncSocket | None = None
        self._streams: dict[int, _StreamState] = {}
        #: When the last frame came from the peer (``time.monotonic()``).
        self.last_rx = 0.0
        self._described = asyncio.Event()
        self.liveness = PeerLiveness(
            self, ticker.interval if ticker is not None else ping_interval, liveness_timeout
        )

    def __repr__(self) -> str:
        iid = f"{self.instance_id:x}" if self.description else "?"
        return f"PeerConnection({self.address}, instance={iid}, {self.state.value})"

    @property
    def instance_id(self) -> int:
        return self.description.instance_id if self.description else 0

    @property
    def routable(self) -> bool:
        """READY, or SILENT (routed to only while no other instance answers), not draining."""
        return self.state in (PeerState.READY, PeerState.SILENT) and not self.draining

    @property
    def open_streams(self) -> int:
        """Streams open on this connection."""
        return len(self._streams)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Create the socket and start connecting (never blocks; see ``wait_described``)."""
        # No ZMTP heartbeats: our pings judge the peer (and keep us alive for its reaper), and
        # its ROUTER's heartbeats close a dead connection; at 256 peers both would double the
        # idle traffic of this process's I/O thread.
        sock = make_socket(self._res.zctx, zmq.DEALER, server_key=self.server_key,
                           heartbeat_ms=0)
        # Monitor before connecting, or a fast handshake is over before anyone listens.
        monitor = sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
            | HANDSHAKE_FAILED
        )
        sock.connect(self.address)
        self._sock = AsyncSocket(sock)
        self.liveness.monitor = AsyncSocket(monitor)
        name = f"peer-{self.address}"
        self._res.spawn(self._recv_loop(), f"{name}-recv")
        self._res.spawn(self.liveness.monitor_loop(), f"{name}-monitor")
        if self._ticker is not None:
            self._ticker.add(self.liveness)
        else:
            self._res.spawn(self.liveness.ping_loop(), f"{name}-ping")

    async def wait_described(self, timeout: float) -> Description:
        """Wait for the first DESCRIBE answer; raises ConnectionTimeout."""
        if not await wait_event(self._described, timeout):
            raise errors.ConnectionTimeout(
                f"{self.address} did not answer within {timeout}s"
            )
        assert self.description is not None
        return self.description

    async def close(self) -> None:
        if self.state is PeerState.CLOSED:
            return
        self._fail_streams(errors.Disconnected(f"connection to {self.address} closed"))
        self.state = PeerState.CLOSED
        if self._ticker is not None:
            self._ticker.discard(self.liveness)
        await self._res.close()  # the loops and any control message still waiting to go out
        if self._sock is not None:
            with contextlib.suppress(Exception):
                self._sock.sock.disable_monitor()
            self._sock.close()
        if self.liveness.monitor is not None:
            self.liveness.monitor.close()
        self._changed()

    # -- streams ---------------------------------------------------------------------------

    async def open_stream(
        self,
        endpoint: str,
        payload: msgspec.Raw,
        context: Context | None = None,
        *,
        decode: ItemDecoder[T],
        window: int = DEFAULT_WINDOW,
        timeout: float | None = None,
        idle_timeout: float | None = None,
    ) -> ResponseStream[T]:
        """Send a request and return its response stream, whose items ``decode`` makes.

        ``context`` links the call: stopping or killing it reaches the server. ``timeout`` is a
        deadline the server enforces (ResponseTimeout); ``idle_timeout`` bounds the wait for each
        next item on this side.
        """
        if self.state not in (PeerState.READY, PeerState.SILENT) or self._sock is None:
            raise errors.CannotConnect(f"instance at {self.address} is {self.state.value}")
        ctx = context if context is not None else Context()
        request_id = next(_request_ids)
        st = _StreamState(request_id, window, decode, endpoint)
        self._streams[request_id] = st
        req = Request(request_id, endpoint, ctx.id(), payload, window, timeout, outgoing())
        result = await self._sock.send([Kind.REQUEST, encode(req)], timeout=self.liveness.timeout)
        if result != SendResult.SENT:
            self._streams.pop(request_id, None)
            raise errors.CannotConnect(f"could not send to {self.address}")
        if self.state in (PeerState.DOWN, PeerState.CLOSED) and not st.done:
            st.terminate(errors.Disconnected(f"instance at {self.address} went away"))

        def on_cancel(killed: bool) -> None:
            if st.done:
                return
            self.send_control(Kind.KILL if killed else Kind.STOP, Control(request_id))
            if killed:  # abandon now: items already received are dropped too
                st.items.clear()
                st.terminate(errors.Cancelled("request killed by the caller"))

        st.unlink = ctx.add_listener(on_cancel)
        return ResponseStream(self, st, ctx, idle_timeout)

    def forget_stream(self, request_id: int) -> None:
        """Stop tracking the stream ``request_id`` (its caller is done with it)."""
        self._streams.pop(request_id, None)

    def serves(self, endpoint: str) -> bool:
        """Whether the peer lists ``endpoint`` (a failing health check leaves it out)."""
        desc = self.description
        return desc is not None and any(ep.path == endpoint for ep in desc.endpoints)

    def send_control(self, kind: bytes, msg: msgspec.Struct) -> None:
        """Send a control frame (STOP, KILL, CREDIT, PING, DESCRIBE) without waiting; a full
        queue hands it to a task that waits for room (bounded by the liveness timeout)."""
        if self._sock is None or self._sock.closed:
            return
        if self._sock.try_send([kind, encode(msg)]) == SendResult.FULL and not self._res.closed:
            send = self._sock.send([kind, encode(msg)], timeout=self.liveness.timeout)
            self._res.spawn(send, f"control-{self.address}")

    def _fail_streams(self, error: errors.DynamoError, kill: bool = False) -> None:
        """End every open stream with ``error``; ``kill``: also send KILL for each (best effort,
        never waiting), so a peer that was only stalled drops them when it reads again."""
        streams, self._streams = self._streams, {}
        for st in streams.values():
            st.terminate(error)
        sock = self._sock
        if kill and sock is not None and not sock.closed:
            for request_id in streams:
                if sock.try_send([Kind.KILL, encode(Control(request_id))]) != SendResult.SENT:
                    break

    # -- background loops ------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        await self._sock.drain_forever(self._dispatch, self.address)

    def drain_pending(self) -> None:
        """Deliver the frames already queued on the socket (before judging the peer)."""
        if self._sock is not None:
            self._sock.drain(self._dispatch, self.address)

    def _dispatch(self, frames: list[bytes]) -> None:
        self.last_rx = time.monotonic()
        self.frames_received += 1
        if len(frames) != 2 or frames[0] not in _decoders:
            log.warning("malformed frame from %s: %d parts", self.address, len(frames))
            return
        kind = frames[0]
        try:
            msg = _decoders[kind].decode(frames[1])
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
            log.warning("undecodable %r frame from %s: %s", kind, self.address, exc)
            return
        # the frame's kind chose the decoder, so the decoded type tells the kind
        if isinstance(msg, RawData):
            self._on_data(msg)
        elif isinstance(msg, End):
            self._on_end(msg, None)
        elif isinstance(msg, Error):
            self._on_end(msg, msg)
        elif isinstance(msg, RawBatch):
            for data in msg.data:
                self._on_data(data)
            for end in msg.ends:
                self._on_end(end, None)
            for err in msg.errors:
                self._on_end(err, err)
        elif isinstance(msg, Pong):
            self.inflight = msg.inflight
            self._on_state(msg.instance_id, msg.rev, msg.draining)
        elif isinstance(msg, Notice):
            self._on_state(msg.instance_id, msg.rev, msg.draining)
        elif isinstance(msg, Description):
            self._on_description(msg)

    def _on_data(self, msg: RawData) -> None:
        st = self._streams.get(msg.request_id)
        if st is None or st.done:
            return
        if msg.seq != st.expected_seq:
            self.send_control(Kind.KILL, Control(st.request_id))
            st.terminate(
                errors.StreamIncomplete(f"frame {msg.seq} arrived, expected {st.expected_seq}")
            )
            return
        st.expected_seq += 1
        try:
            st.items.extend(st.decode(msg.items))
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            items, error = decode_items(st.decode, msg.items)
            st.items.extend(items)
            if error is not None:  # the items before it are still delivered
                self.send_control(Kind.KILL, Control(st.request_id))
                st.terminate(error)
        st.waiter.set()

    def _on_end(self, msg: End | Error, error: Error | None) -> None:
        st = self._streams.get(msg.request_id)
        if st is None:
            if error is not None and msg.request_id == 0:
                log.warning("%s reported: %s: %s", self.address, error.kind, error.message)
            return
        if msg.seq != st.expected_seq:
            st.terminate(
                errors.StreamIncomplete(
                    f"stream ended after {msg.seq} frames but {st.expected_seq} arrived"
                )
            )
        elif error is not None:
            st.terminate(errors.from_wire(error.kind, error.message))
        else:
            st.terminate(None)

    def _on_state(self, instance_id: int, rev: int, draining: bool) -> None:
        desc = self.description
        if desc is None or desc.instance_id != instance_id or desc.rev != rev:
            self.liveness.request_description()
        elif self.state is not PeerState.READY:
            if self.state is PeerState.SILENT:
                log.info("peer %s answers again: routable", self)
            self.state = PeerState.READY  # came back from a stall
            self._changed()
        if draining != self.draining:
            self.draining = draining
            self._changed()

    def _on_description(self, desc: Description) -> None:
        if desc.protocol_version != PROTOCOL_VERSION:
            if self.state is not PeerState.DOWN:
                log.warning(
                    "%s speaks protocol %d, this process %d: not routing to it",
                    self.address, desc.protocol_version, PROTOCOL_VERSION,
                )
            self.mark_down("speaks another protocol version")
            return
        old = self.description
        if old is not None and old.instance_id != desc.instance_id:
            # Same address, new process: the old instance's streams cannot complete.
            self._fail_streams(errors.Disconnected(f"instance {old.instance_id:x} was replaced"))
        self.description = desc
        if self.server_key is not None and (curve := current_curve()) is not None:
            curve.remember(desc.instance_id, self.server_key)
        self.draining = desc.draining
        self.state = PeerState.READY
        self._described.set()
        self._changed()

    def mark_down(self, reason: str) -> None:
        """End every open stream with ``Disconnected`` (sending KILL for each) and mark the peer
        DOWN, saying why; ZMQ keeps reconnecting."""
        if self.state is PeerState.CLOSED:
            return
        if self.state is not PeerState.DOWN:
            log.info("peer %s down: %s", self, reason)
        self._fail_streams(errors.Disconnected(f"instance at {self.address} {reason}"), kill=True)
        if self.state is not PeerState.DOWN:
            self.state = PeerState.DOWN
            self._changed()

    def mark_silent(self, reason: str) -> None:
        """A READY peer leaves routing (SILENT), keeping its streams, until it answers."""
        if self.state is PeerState.READY:
            log.info("peer %s silent: %s; out of routing until it answers", self, reason)
            self.state = PeerState.SILENT
            self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            try:
                self._on_change(self)
            except Exception:
                log.exception("peer change callback failed")
