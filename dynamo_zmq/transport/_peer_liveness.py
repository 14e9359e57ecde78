"""Whether a peer is alive, seen from the calling side: the DEALER socket's monitor events
(handshake, disconnect, a failed CURVE handshake), application pings, and two judgements of
its silence (neither made right after this process itself stalled):

- a ping not answered within ``ANSWER_TIMEOUT`` (0.3 s) makes a READY peer SILENT: out of
  routing, its streams kept, back to READY with its next answer (a frozen host, a stuck loop:
  out of routing 0.3-0.8 s after it stopped, pings 0.5 s apart);
- a peer that has sent nothing for the liveness timeout (1.5 s) is marked DOWN: its streams
  fail with ``Disconnected`` and migrate.

A connection pings on its own (``ping_loop``), or, in a pool, on a ``PingTicker`` the pool's
connections share: one task for all of them, two wake-ups per interval (the pings, then the
answers judged), instead of one task per connection (1,024 wake-ups a second at 256 peers).

Each ``PeerConnection`` owns one ``PeerLiveness``, which keeps the liveness state (connected,
quiet after a stall, the ping nonces) and reaches the connection only through ``LivePeer``; none
of it is on the per-message path (the connection's receive path only stamps ``last_rx``).
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from typing import Protocol

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from ..resources import Resources
from ..wire import Describe, Description, Kind, Ping
from ._sockets import AsyncSocket

__all__ = ["ANSWER_TIMEOUT", "HANDSHAKE_FAILED", "PING_INTERVAL", "LivePeer", "PeerLiveness",
           "PeerState", "PingTicker"]

# Its lines were always the connection's: keep the logger they are filtered by.
log = logging.getLogger("dynamo_zmq.transport.client")


#: Seconds between two application pings of a peer (the liveness timeout is three of them).
PING_INTERVAL = 0.5
#: Seconds a ping may go unanswered before its peer leaves routing (SILENT). A live peer
#: answers in a millisecond on a LAN; 0.3 s is a stalled loop or a frozen process. Out of
#: routing is cheap to undo (the next answer), so this is short; failing the peer's streams
#: waits for the liveness timeout.
ANSWER_TIMEOUT = 0.3


class PeerState(enum.Enum):
    """Where a ``PeerConnection`` stands."""

    CONNECTING = "connecting"  # no handshake yet, or handshake done but not described yet
    READY = "ready"  # described and answering pings
    SILENT = "silent"  # described, but a ping went unanswered: out of routing, streams kept
    DOWN = "down"  # lost: disconnected or not answering; ZMQ keeps reconnecting
    CLOSED = "closed"


#: Monitor events of a failed handshake (a wrong key, or a peer without CURVE).
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class LivePeer(Protocol):
    """What liveness reads and calls on its connection (``PeerConnection``)."""

    address: str
    #: When the last frame came from the peer (``time.monotonic()``).
    last_rx: float

    @property
    def state(self) -> PeerState: ...

    @property
    def description(self) -> Description | None: ...

    def send_control(self, kind: bytes, msg: msgspec.Struct) -> None:
        """Send a control frame without waiting."""
        ...

    def drain_pending(self) -> None:
        """Deliver the frames already queued on the data socket."""
        ...

    def mark_down(self, reason: str) -> None:
        """End every open stream and mark the peer DOWN, saying why."""
        ...

    def mark_silent(self, reason: str) -> None:
        """Take a READY peer out of routing (SILENT), keeping its streams."""
        ...


class PeerLiveness:
    """Whether one peer is alive (see the module docstring); its connection owns it.

    Args:
        peer: the connection.
        interval: seconds between application pings (a ``PingTicker``'s when it has one).
        timeout: a READY or SILENT peer silent for this long is marked DOWN.
        answer_timeout: a READY peer that has not answered a ping for this long is SILENT
            (None: never; then only ``timeout`` judges it).
    """

    def __init__(self, peer: LivePeer, interval: float, timeout: float,
                 answer_timeout: float | None = ANSWER_TIMEOUT) -> None:
        self.peer = peer
        self.interval = interval
        self.timeout = timeout
        self.answer_timeout = answer_timeout
        #: When the oldest ping not answered yet went out (answered: ``last_rx`` is later).
        self.pinged_at = 0.0
        #: The connection's socket monitor (set when it starts).
        self.monitor: AsyncSocket | None = None
        self.connected = False
        self.handshake_failed = False
        #: Until then silence is not judged: this process has just come back from a stall.
        self.quiet_until = 0.0
        self.last_describe = 0.0
        self.nonce = itertools.count(1)

    async def monitor_loop(self) -> None:
        """Follow the socket monitor: connected, disconnected, handshake failed."""
        mon, peer = self.monitor, self.peer
        assert mon is not None
        while not mon.closed:
            while (frames := mon.recv_nowait()) is not None:
                event = parse_monitor_message(frames)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.connected = True
                    peer.last_rx = time.monotonic()
                    self.request_description()
                elif event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                    self.connected = False
                    # Frames that arrived before the connection dropped are still queued on the
                    # data socket: deliver them first, so finished streams end cleanly.
                    peer.drain_pending()
                    peer.mark_down("disconnected")
                elif event & HANDSHAKE_FAILED and not self.handshake_failed:
                    # A wrong server key, a peer without CURVE, or one that refuses our key:
                    # ZMQ retries, we say it once.
                    self.handshake_failed = True
                    log.warning("%s: the CURVE handshake failed (its key is not the advertised "
                                "one, or it does not accept ours)", peer.address)
            await mon.wait_readable()

    async def ping_loop(self) -> None:
        """Ping every ping interval (or ask who it is until it has said) and judge the peer's
        silence after each ping, and whether it answered ``answer_timeout`` later."""
        pause = _pauses(self.interval, self.answer_timeout)
        last = time.monotonic()
        while True:
            for step, slept in enumerate(pause):
                await asyncio.sleep(slept)
                now = time.monotonic()
                if _woke_late(now, last, slept, self.timeout):
                    self.quiet(now)
                last = now
                if step == 0:
                    self.ping_once()
                else:
                    self.check_answer()

    def quiet(self, now: float) -> None:
        """Judge no silence for two pings' time from ``now`` (this process just stalled)."""
        self.quiet_until = now + 2 * self.interval

    def request_description(self) -> None:
        """Ask the peer who it is (DESCRIBE), at most every 0.2 s."""
        now = time.monotonic()
        if now - self.last_describe > 0.2:
            self.last_describe = now
            self.peer.send_control(Kind.DESCRIBE, Describe(next(self.nonce)))

    def ping_once(self) -> None:
        """One ping (a DESCRIBE until the peer has described itself), then its silence
        judged."""
        if self.peer.description is None:
            self.request_description()  # dropped harmlessly while not connected
            return
        if not self.connected:
            return
        if self.peer.last_rx >= self.pinged_at:  # the last ping was answered
            self.pinged_at = time.monotonic()
        # Always, even while its streams bring data: the pings are what keep this caller alive
        # for the peer's reaper (``Server``'s CLIENT_TIMEOUT).
        self.peer.send_control(Kind.PING, Ping(next(self.nonce)))
        self.check_silence()

    def check_answer(self) -> None:
        """Take the peer out of routing (SILENT) if nothing came from it since a ping that went
        out ``answer_timeout`` ago or earlier."""
        peer, pinged = self.peer, self.pinged_at
        if peer.last_rx >= pinged or self.answer_timeout is None:
            return  # answered (the common case: two reads and a comparison)
        if peer.state is not PeerState.READY:
            return
        now = time.monotonic()
        # (90%: a pool's pings go out one after another, a little after the tick)
        if now - pinged < 0.9 * self.answer_timeout or now < self.quiet_until:
            return
        peer.drain_pending()  # what this process has not read yet proves the peer alive
        if peer.last_rx < pinged:
            peer.mark_silent(f"no answer to a ping for {now - pinged:.2f}s")

    def check_silence(self) -> None:
        """Mark the peer down if nothing came from it for the liveness timeout."""
        peer = self.peer
        if peer.state is not PeerState.READY and peer.state is not PeerState.SILENT:
            return
        now = time.monotonic()
        if now - peer.last_rx <= self.timeout or now < self.quiet_until:
            return
        # After a stall of this process (GC, a busy loop, CPU starvation) this can run before
        # the receive loop has read what arrived meanwhile: that proves the peer alive.
        peer.drain_pending()
        silent = time.monotonic() - peer.last_rx
        if silent > self.timeout:
            peer.mark_down(f"silent for {silent:.1f}s")


def _woke_late(now: float, last: float, slept: float, timeout: float) -> bool:
    """This process woke late: it (or the whole machine) stalled, and peers may have stalled
    with it. They get a few pings' time to answer before they are judged."""
    return now - last - slept > timeout / 3


def _pauses(interval: float, answer_timeout: float | None) -> tuple[float, ...]:
    """The sleeps of one ping interval: before the pings, and (with an answer timeout) before
    their answers are judged."""
    if answer_timeout is None or not 0 < answer_timeout < interval:
        return (interval,)
    return (interval - answer_timeout, answer_timeout)


class PingTicker:
    """Pings every connection added to it once an interval, and judges their answers
    ``answer_timeout`` later, from one task owned by ``resources`` (started with the first
    connection)."""

    def __init__(self, resources: Resources, interval: float = PING_INTERVAL,
                 answer_timeout: float | None = ANSWER_TIMEOUT) -> None:
        self._res = resources
        self.interval = interval
        self.answer_timeout = answer_timeout
        self._peers: dict[PeerLiveness, None] = {}
        self._task: asyncio.Task[None] | None = None

    def add(self, live: PeerLiveness) -> None:
        """Ping ``live``'s peer from now on."""
        self._peers[live] = None
        if self._task is None and not self._res.closed:
            self._task = self._res.spawn(self._run(), "peer-pings")

    def discard(self, live: PeerLiveness) -> None:
        """Stop pinging ``live``'s peer."""
        self._peers.pop(live, None)

    async def _run(self) -> None:
        pause = _pauses(self.interval, self.answer_timeout)
        last = time.monotonic()
        while True:
            for step, slept in enumerate(pause):
                await asyncio.sleep(slept)
                now = time.monotonic()
                woke, last = last, now
                for live in list(self._peers):
                    if _woke_late(now, woke, slept, live.timeout):
                        live.quiet(now)
                    try:
                        if step == 0:
                            live.ping_once()
                        else:
                            live.check_answer()
                    except Exception:  # one peer's failure must not stop the others' liveness
                        log.exception("pinging %s failed", live.peer.address)
