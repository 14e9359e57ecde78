"""Whether a peer is alive, seen from the calling side: the DEALER socket's monitor events
(handshake, disconnect, a failed CURVE handshake), application pings, and the silence check
that marks a READY peer DOWN (but not right after this process itself stalled).

A connection pings on its own (``ping_loop``), or, in a pool, on a ``PingTicker`` the pool's
connections share: one task and one wake-up per interval for all of them, instead of one per
connection (1,024 wake-ups a second at 256 peers).

These run beside a ``PeerConnection`` on its own state; none of it is on the per-message path
(that is ``PeerConnection._dispatch``, which only stamps ``_last_rx``).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from typing import TYPE_CHECKING

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..resources import Resources
from ..wire import Kind, Ping

if TYPE_CHECKING:
    from .client import PeerConnection

__all__ = [
    "HANDSHAKE_FAILED", "PING_INTERVAL", "PeerState", "PingTicker", "check_silence",
    "monitor_loop", "ping_loop",
]

# Its lines were always the connection's: keep the logger they are filtered by.
log = logging.getLogger("dynamo_zmq.transport.client")


#: Seconds between two application pings of a peer (the liveness timeout is three of them).
PING_INTERVAL = 0.5


class PeerState(enum.Enum):
    """Where a ``PeerConnection`` stands."""

    CONNECTING = "connecting"  # no handshake yet, or handshake done but not described yet
    READY = "ready"  # described and answering pings
    DOWN = "down"  # lost: disconnected or not answering; ZMQ keeps reconnecting
    CLOSED = "closed"


#: Monitor events of a failed handshake (a wrong key, or a peer without CURVE).
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


async def monitor_loop(peer: PeerConnection) -> None:
    """Follow ``peer``'s socket monitor: connected, disconnected, handshake failed."""
    mon = peer._monitor
    assert mon is not None
    while not mon.closed:
        while (frames := mon.recv_nowait()) is not None:
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                peer._connected = True
                peer._last_rx = time.monotonic()
                peer._request_description()
            elif event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                peer._connected = False
                # Frames that arrived before the connection dropped are still queued on the
                # data socket: deliver them first, so finished streams end cleanly.
                peer._drain_pending()
                peer._mark_down("disconnected")
            elif event & HANDSHAKE_FAILED and not peer._handshake_failed:
                # A wrong server key, a peer without CURVE, or one that refuses our key:
                # ZMQ retries, we say it once.
                peer._handshake_failed = True
                log.warning("%s: the CURVE handshake failed (its key is not the advertised "
                            "one, or it does not accept ours)", peer.address)
        await mon.wait_readable()


async def ping_loop(peer: PeerConnection) -> None:
    """Ping ``peer`` every ping interval (or ask who it is until it has said) and judge its
    silence after each ping."""
    last = time.monotonic()
    while True:
        await asyncio.sleep(peer._ping_interval)
        now = time.monotonic()
        if _woke_late(now, last, peer._ping_interval, peer._liveness_timeout):
            _quiet(peer, now)
        last = now
        ping_once(peer)


def _woke_late(now: float, last: float, interval: float, timeout: float) -> bool:
    """This process woke late: it (or the whole machine) stalled, and peers may have stalled
    with it. They get a few pings' time to answer before they are judged."""
    return now - last - interval > timeout / 3


def _quiet(peer: PeerConnection, now: float) -> None:
    peer._quiet_until = now + 2 * peer._ping_interval


def ping_once(peer: PeerConnection) -> None:
    """One ping of ``peer`` (a DESCRIBE until it has described itself), then its silence
    judged."""
    if peer.description is None:
        peer._request_description()  # dropped harmlessly while not connected
        return
    if not peer._connected:
        return
    # Always, even while its streams bring data: the pings are what keep this caller alive
    # for the peer's reaper (``Server``'s CLIENT_TIMEOUT).
    peer.send_control(Kind.PING, Ping(next(peer._nonce)))
    check_silence(peer)


class PingTicker:
    """Pings every connection added to it once an interval, from one task owned by
    ``resources`` (started with the first connection)."""

    def __init__(self, resources: Resources, interval: float = PING_INTERVAL) -> None:
        self._res = resources
        self.interval = interval
        self._peers: dict[PeerConnection, None] = {}
        self._task: asyncio.Task[None] | None = None

    def add(self, peer: PeerConnection) -> None:
        self._peers[peer] = None
        if self._task is None and not self._res.closed:
            self._task = self._res.spawn(self._run(), "peer-pings")

    def discard(self, peer: PeerConnection) -> None:
        self._peers.pop(peer, None)

    async def _run(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.interval)
            now = time.monotonic()
            woke, last = last, now
            for peer in list(self._peers):
                if _woke_late(now, woke, self.interval, peer._liveness_timeout):
                    _quiet(peer, now)
                try:
                    ping_once(peer)
                except Exception:  # one peer's failure must not stop the others' liveness
                    log.exception("pinging %s failed", peer.address)


def check_silence(peer: PeerConnection) -> None:
    """Mark ``peer`` down if nothing came from it for the liveness timeout."""
    if peer.state is not PeerState.READY:
        return
    now = time.monotonic()
    if now - peer._last_rx <= peer._liveness_timeout or now < peer._quiet_until:
        return
    # After a stall of this process (GC, a busy loop, CPU starvation) this can run before
    # the receive loop has read what arrived meanwhile: that proves the peer alive.
    peer._drain_pending()
    silent = time.monotonic() - peer._last_rx
    if silent > peer._liveness_timeout:
        peer._mark_down(f"silent for {silent:.1f}s")
