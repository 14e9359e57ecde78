"""The one place ZMQ sockets are made, and their asyncio driver.

``make_socket`` applies the options every socket of a kind needs (linger, HWM, heartbeats,
ROUTER_MANDATORY; on every socket that connects, the connect timeout, reconnect interval and
retransmission limit that bring a peer back within a second of a healed partition).
``AsyncSocket`` drives a plain (non-asyncio) pyzmq socket from the event loop: receives drain
with non-blocking calls until the queue is empty and only then await readiness (far more
frames/s than one ``await`` per frame), and sends never block the loop.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Callable
from typing import cast

import zmq
from zmq.backend import Socket as _Backend

from .. import errors
from ..resources import wait_event
from ._curve import current_curve

__all__ = ["AsyncSocket", "SendResult", "make_socket", "set_connect_options"]

log = logging.getLogger(__name__)

# Plain ints: pyzmq's enum flags cost several microseconds per operation on the hot path.
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)
_EVENTS = int(zmq.EVENTS)
_SRCFD = int(zmq.SRCFD)
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
# pyzmq's compiled send, receive and option reads, called directly: its Python layer
# (send_multipart's loop, flag enums, copy thresholds) costs more than the call itself
# (a two-part send 2.5 us -> 0.5 us here).
_send = _Backend.send
_recv = _Backend.recv
_get = _Backend.get

#: Seconds a connection of a ``keepalive`` socket is idle before the kernel probes it (then
#: every second, 3 times).
KEEPALIVE_IDLE = 3

#: Per-peer queue limit in messages. Streams are flow-controlled by credit, so this only bounds
#: what one slow peer can hold; a full queue is backpressure, never a drop (ROUTER_MANDATORY).
DEFAULT_HWM = 10_000


#: Milliseconds a TCP connect may take before ZMQ gives it up and tries again
#: (``ZMQ_CONNECT_TIMEOUT``). Without it a connect started while the peer is unreachable waits
#: in the kernel's SYN backoff (1, 2, 4, 8, 16 s...), so a peer came back up to tens of seconds
#: after a partition healed.
CONNECT_TIMEOUT_MS = 500
#: Milliseconds before the first reconnect, and the most they back off to.
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 250
#: Milliseconds sent data may stay unacknowledged before the kernel drops the connection
#: (``ZMQ_TCP_MAXRT``: TCP_USER_TIMEOUT on Linux), and ZMQ reconnects. A connection cut by a
#: partition otherwise stays ESTABLISHED in retransmission backoff (0.2 s doubling to 2 min),
#: and its next retransmission after the heal comes up to tens of seconds later. A live peer's
#: kernel acknowledges at once, even with the peer's process stopped or busy.
TCP_MAXRT_MS = 2000


def set_connect_options(sock: zmq.Socket[bytes]) -> None:
    """Bound how long a connecting socket's connects and dead connections take to be retried
    (see ``CONNECT_TIMEOUT_MS``, ``RECONNECT_IVL_MS``, ``TCP_MAXRT_MS``). ``make_socket`` calls
    it for every socket it does not bind; call it on a socket made otherwise, before
    ``connect``."""
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    sock.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)
    sock.setsockopt(zmq.TCP_MAXRT, TCP_MAXRT_MS)


def make_socket(
    zctx: zmq.Context[zmq.Socket[bytes]],
    socket_type: int,
    *,
    bind: str | None = None,
    connect: str | None = None,
    hwm: int = DEFAULT_HWM,
    heartbeat_ms: int = 500,
    keepalive: bool = False,
    server_key: bytes | None = None,
    curve: bool = True,
    zap_domain: str | None = None,
) -> zmq.Socket[bytes]:
    """Create a socket with the project's standard options, bound or connected.

    ``bind`` may end in ``:0`` or ``:*`` for an ephemeral port; read it back with
    ``LAST_ENDPOINT``. An address that cannot be bound raises ``errors.InvalidArgument``.
    ``keepalive``: TCP keepalive, probing a connection idle for ``KEEPALIVE_IDLE`` seconds
    (a peer that vanished without a word is dropped some seconds later).

    With auth on (``_curve.enable_curve``), a bound socket is a CURVE server and any other a
    CURVE client of ``server_key`` (the Z85 public key of what it will connect to), which must
    be authorized, else ``CurveRefused`` (an ``errors.CannotConnect``) is raised. A bound
    socket's ``zap_domain`` (a ``_key_roles.Domain``) says what kind of socket it is, so which
    roles of authorized keys it admits (None: every role). ``curve=False``
    keeps a socket plaintext even then, for loopback only (a process's own plaintext peers,
    e.g. vLLM's KV-event sockets): any other address raises ``errors.InvalidArgument``.
    """
    if not curve and not all(_loopback(a) for a in (bind, connect) if a is not None):
        raise errors.InvalidArgument(f"a plaintext socket may only use loopback: {bind or connect}")
    sock = zctx.socket(socket_type)
    try:
        auth = current_curve() if curve else None
        if auth is not None:
            if bind is not None:
                auth.make_server(sock, zap_domain)
            else:
                auth.make_client(sock, server_key, connect or "")
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        if socket_type == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if bind is None:
            # Not IMMEDIATE on a DEALER: with it, ZMQ drops the frames already received from a
            # peer when the connection drops (a finished stream's terminal could be lost).
            # Callers check the peer is READY before sending a request instead.
            set_connect_options(sock)
        if heartbeat_ms and socket_type in (zmq.ROUTER, zmq.DEALER):
            # ZMTP heartbeats run on ZMQ's I/O thread: they find a dead host or a cut link even
            # when no application traffic flows. A stuck event loop is found by our own pings.
            sock.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ms)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, heartbeat_ms * 3)
            sock.setsockopt(zmq.HEARTBEAT_TTL, heartbeat_ms * 4)
        if keepalive:
            sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
            sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE)
            sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 1)
            sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
        if bind is not None:
            if bind.endswith(":0"):
                bind = bind[:-2] + ":*"
            try:
                sock.bind(bind)
            except zmq.ZMQError as exc:  # the port is taken, the host is not ours...
                # ZMQError always sets errno (from zmq_errno() when not given)
                reason = zmq.strerror(exc.errno) if exc.errno is not None else str(exc)
                raise errors.InvalidArgument(f"cannot bind {bind}: {reason}") from exc
            if auth is not None:
                port = sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[-1]
                if port.isdigit():
                    auth.note_bound(int(port), zap_domain)
        if connect is not None:
            sock.connect(connect)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def _loopback(address: str) -> bool:
    return address.startswith(("tcp://127.", "ipc://", "inproc://"))


class SendResult:
    SENT = 0
    FULL = 1  # the peer's queue is at its HWM: try again later
    GONE = 2  # the peer is not connected (ROUTER_MANDATORY: EHOSTUNREACH)


class AsyncSocket:
    """Drives a non-blocking pyzmq socket from the running asyncio loop.

    The ZMQ file descriptor is edge-triggered: it signals when the socket's event state may have
    changed, and reading ``EVENTS`` re-arms it. Every operation here therefore re-checks
    ``EVENTS`` afterwards, so a readiness change consumed by a send is never missed.

    While ``drain_forever`` runs, messages are handed to its ``dispatch`` from the loop's reader
    callback itself: no task wakes, no future is made per burst (at 256 peers, each pong and
    load report costs a wake-up otherwise).
    """

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._fd = sock.fileno()  # the ZMQ_FD option
        self._closed = False
        #: ``drain_forever``'s dispatch and what the messages are from (None: none runs).
        self._dispatch: tuple[Callable[[list[bytes]], object], str] | None = None
        self._draining = False
        self._drain_soon = False
        #: Whether to read who sent each message (``sender``): a ROUTER's CURVE caller.
        self.senders = False
        #: The Z85 CURVE key and file descriptor of the connection the message just received
        #: came from (with ``senders``; None without CURVE).
        self.sender: tuple[str, int] | None = None
        self._loop.add_reader(self._fd, self._poll_events)

    def _poll_events(self, inline: bool = True) -> None:
        """Read ``EVENTS`` (which re-arms the fd) and act on it. From a send (``inline``
        False) messages are not dispatched there and then, inside the sender's code, but from
        the loop's next turn."""
        if self._closed:
            return
        try:
            # ZMQ_EVENTS is an int option; pyzmq types every getsockopt as ``int | bytes``
            events = cast(int, self.sock.getsockopt(_EVENTS))
        except zmq.ZMQError:
            return
        if events & _POLLIN:
            if self._dispatch is None or self._draining:
                self._readable.set()
            elif inline:
                self._drain_ready(*self._dispatch, readable=True)
                return  # the drain read EVENTS last, and acted on POLLOUT
            elif not self._drain_soon:
                self._drain_soon = True
                self._loop.call_soon(self._drain_later)
        if events & _POLLOUT:
            self._writable.set()

    def _drain_later(self) -> None:
        self._drain_soon = False
        self._poll_events()

    def recv_nowait(self) -> list[bytes] | None:
        """One multipart message, or None when the queue is empty."""
        try:
            return self._recv_message()
        except zmq.Again:
            return None

    def _recv_message(self) -> list[bytes]:
        """One multipart message (raises ``zmq.Again`` when there is none)."""
        sock = self.sock
        frames: list[bytes] = [_recv(sock, _NOBLOCK)]
        if self.senders:
            self.sender = None
        if self.senders and _get(sock, _RCVMORE):
            # The second part as a Frame: it carries its connection's properties.
            frame = _recv(sock, _NOBLOCK, False)
            try:
                self.sender = (str(frame.get("User-Id")), int(frame.get(_SRCFD)))
            except zmq.ZMQError:  # no CURVE on the connection: no key to tell
                self.sender = None
            frames.append(frame.bytes)
        while _get(sock, _RCVMORE):
            frames.append(_recv(sock, _NOBLOCK))
        return frames

    @property
    def closed(self) -> bool:
        return self._closed

    def drain(self, dispatch: Callable[[list[bytes]], object], what: str) -> None:
        """Hand every message already queued to ``dispatch``, without waiting. A ``dispatch``
        that raises is a bug, not bad input: it is logged and the next message handled."""
        if not self._draining:  # else the drain running below this call reads them
            self._drain_ready(dispatch, what)

    def _drain_ready(
        self, dispatch: Callable[[list[bytes]], object], what: str, readable: bool = False
    ) -> None:
        """Receive and dispatch until the queue is empty (``readable``: EVENTS was just read
        and said POLLIN)."""
        self._draining = True
        events = _POLLIN if readable else 0
        sock = self.sock
        try:
            # Ask EVENTS before each receive: an empty queue then costs no zmq.Again raised.
            while not self._closed:
                if not readable:
                    events = cast(int, _get(sock, _EVENTS))
                    if not events & _POLLIN:
                        break
                readable = False
                try:
                    frames = self._recv_message()
                except zmq.Again:
                    break
                try:
                    dispatch(frames)
                except Exception:
                    log.exception("error handling a message from %s", what)
        except zmq.ZMQError:
            return  # closed under us
        finally:
            self._draining = False
        if events & _POLLOUT:
            self._writable.set()

    async def drain_forever(self, dispatch: Callable[[list[bytes]], object], what: str) -> None:
        """Hand every message to ``dispatch`` as it arrives (from the reader callback), until
        the socket is closed or this coroutine is cancelled."""
        if self._dispatch is not None:
            raise RuntimeError("the socket is drained already")
        self._dispatch = (dispatch, what)
        try:
            while not self._closed:
                self.drain(dispatch, what)  # what arrived before, or while nobody listened
                self._readable.clear()
                await self._readable.wait()  # set only by close() while dispatching
        finally:
            self._dispatch = None

    async def wait_readable(self) -> None:
        """Return when a message can be received (or the socket was closed)."""
        while not self._closed:
            if cast(int, self.sock.getsockopt(_EVENTS)) & _POLLIN:
                return
            self._readable.clear()
            await self._readable.wait()

    def try_send(self, frames: list[bytes]) -> int:
        """Send without blocking; returns a ``SendResult``. (ZMQ takes a multipart message
        whole or not at all: only its first part can meet a full queue or a gone peer.)"""
        sock = self.sock
        try:
            last = len(frames) - 1
            for i, frame in enumerate(frames):
                _send(sock, frame, _NOBLOCK if i == last else _SNDMORE | _NOBLOCK)
            return SendResult.SENT
        except zmq.Again:
            return SendResult.FULL
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:
                return SendResult.GONE
            raise
        finally:
            # A send may consume the readiness signal of pending input: look again.
            self._poll_events(inline=False)

    async def send(self, frames: list[bytes], timeout: float | None = None) -> int:
        """Send, waiting while the peer's queue is full; returns SENT or GONE (or FULL on
        timeout)."""
        deadline = None if timeout is None else self._loop.time() + timeout
        backoff = 0.0005
        while True:
            result = self.try_send(frames)
            if result != SendResult.FULL:
                return result
            if deadline is not None and self._loop.time() >= deadline:
                return SendResult.FULL
            # POLLOUT on a ROUTER means "some peer has room", not this one: back off as well.
            self._writable.clear()
            # Not asyncio.wait_for: it can lose a cancellation (Python 3.10/3.11), and this loop
            # would then run on until the deadline, or for ever without one.
            await wait_event(self._writable, backoff)
            backoff = min(backoff * 2, 0.02)

    def close(self, linger_ms: int = 0) -> None:
        """Close; ``linger_ms`` lets ZMQ finish writing what is queued (terminal frames)."""
        if self._closed:
            return
        self._closed = True
        self._readable.set()
        try:
            self._loop.remove_reader(self._fd)
        except Exception:  # loop already closed
            pass
        self.sock.close(linger=linger_ms)
