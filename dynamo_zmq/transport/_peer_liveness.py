"""Whether a peer is alive, seen from the calling side: the DEALER socket's monitor events
(handshake, disconnect, a failed CURVE handshake), application pings, and the silence check
that marks a READY peer DOWN (but not right after this process itself stalled).

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

from ..wire import Kind, Ping

if TYPE_CHECKING:
    from .client import PeerConnection

__all__ = ["HANDSHAKE_FAILED", "PeerState", "check_silence", "monitor_loop", "ping_loop"]

# Its lines were always the connection's: keep the logger they are filtered by.
log = logging.getLogger("dynamo_zmq.transport.client")


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
        if now - last - peer._ping_interval > peer._liveness_timeout / 3:
            # This process woke late: it (or the whole machine) stalled, and the peer may
            # have stalled with it. Give it a few pings' time to answer before judging.
            peer._quiet_until = now + 2 * peer._ping_interval
        last = now
        if peer.description is None:
            peer._request_description()  # dropped harmlessly while not connected
            continue
        if not peer._connected:
            continue
        peer.send_control(Kind.PING, Ping(next(peer._nonce)))
        check_silence(peer)


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
