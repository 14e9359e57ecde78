"""Session pins shared between KV-router replicas (``router/replica_sync.py``): a pin made by
one replica is honoured by the others.

Each time a replica routes a session's request it publishes ``[SESSION_TOPIC, SessionPin]`` on
its replica PUB socket: the session and the (worker, rank) it went to, which its peers ``learn``
as used now. A topic of its own (not ``REPLICA_TOPIC``'s prefix), outside the sequenced request
events: a replica without sessions never receives it, and a lost pin costs no resync (the next
request of the session publishes it again). A replica that joins late learns the pins from the
snapshot it asks each peer for (``sessions``: [session, worker, rank, seconds since last use]).
Every replica expires pins on its own ``--session-ttl``.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from dynamo_zmq.llm import SessionPins
from dynamo_zmq.transport import BadInput

from ._replica_metrics import ReplicaMetrics
from .scheduler import Candidate

__all__ = ["MAX_SESSION", "SESSION_TOPIC", "PinDecodeError", "ReplicaPins", "SessionPin",
           "decode_pin", "encode_pin", "parse_pins"]

log = logging.getLogger(__name__)

SESSION_TOPIC = b"kv-session"
SESSION_VERSION = 1
#: Longest session id carried (the frontend's bound).
MAX_SESSION = 256


class SessionPin(msgspec.Struct, array_like=True, frozen=True):
    """A replica pinned ``session`` to (``worker``, ``dp_rank``) as it routed a request now."""

    version: int
    #: The sending replica's instance id.
    replica: int
    session: str
    worker: int
    dp_rank: int


class PinDecodeError(ValueError):
    """A payload that is not a valid ``SessionPin``."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SessionPin)


def encode_pin(pin: SessionPin) -> bytes:
    return _encoder.encode(pin)


def _valid_session(session: object) -> bool:
    return (isinstance(session, str) and 0 < len(session) <= MAX_SESSION
            and session.isascii() and session.isprintable())


def decode_pin(frames: list[bytes]) -> SessionPin:
    """The pin in a ``[SESSION_TOPIC, payload]`` message.

    Raises:
        PinDecodeError: not two frames, undecodable, another version, a bad session id or
            negative ids.
    """
    if len(frames) != 2 or frames[0] != SESSION_TOPIC:
        raise PinDecodeError(f"malformed session pin message ({len(frames)} frames)")
    try:
        pin = _decoder.decode(frames[1])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise PinDecodeError(f"undecodable session pin: {exc}") from None
    if pin.version != SESSION_VERSION:
        raise PinDecodeError(f"session pin version {pin.version}, not {SESSION_VERSION}")
    if not _valid_session(pin.session):
        raise PinDecodeError(f"session pin of a bad session id {pin.session[:40]!r}")
    if min(pin.replica, pin.worker, pin.dp_rank) < 0:
        raise PinDecodeError("negative id in a session pin")
    return pin


def parse_pins(raw: Any) -> list[tuple[str, Candidate, float]] | None:
    """A snapshot's ``sessions`` as (session, (worker, rank), age); [] when absent (a peer
    without sessions), None when malformed."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        return None
    out: list[tuple[str, Candidate, float]] = []
    for item in raw:
        if (not isinstance(item, list) or len(item) != 4 or not _valid_session(item[0])
                or not all(type(x) is int and x >= 0 for x in item[1:3])
                or type(item[3]) not in (int, float) or not item[3] >= 0):
            return None
        out.append((item[0], (item[1], item[2]), float(item[3])))
    return out


class ReplicaPins:
    """One replica's side of the session pins: publishes its own (``pinned``), applies its
    peers' (``handle``, ``learn``).

    Args:
        pins: the router's session pins (None: it pins none; peers' pins are skipped).
        metrics: the replica metrics (``kind="pin"`` in the events sent and received).
        model: the metrics label.
    """

    def __init__(self, pins: SessionPins | None, metrics: ReplicaMetrics, model: str) -> None:
        self.pins = pins
        self._m, self._model = metrics, model
        self._bad = BadInput(log)
        #: Where ``pinned`` publishes: (send, this replica's instance id), once bound.
        self.send: Any = None
        self.replica = 0

    def pinned(self, session: str, candidate: Candidate) -> None:
        """This replica routed ``session``'s request to ``candidate``: tell the peers."""
        if self.send is None:
            return
        pin = SessionPin(SESSION_VERSION, self.replica, session, *candidate)
        self.send(SESSION_TOPIC, encode_pin(pin))
        self._m.sent.labels(self._model, "pin").inc()

    def handle(self, iid: int, frames: list[bytes]) -> bool:
        """Apply peer ``iid``'s pin message; False if it was rejected (counted)."""
        try:
            pin = decode_pin(frames)
        except PinDecodeError as exc:
            return self._reject(iid, str(exc))
        if pin.replica != iid:
            return self._reject(iid, f"session pin from instance {pin.replica:x}")
        self._m.received.labels(self._model, "pin").inc()
        if self.pins is not None:
            self.pins.learn(pin.session, (pin.worker, pin.dp_rank))
        return True

    def learn(self, pins: list[tuple[str, Candidate, float]]) -> None:
        """A peer's snapshot's pins."""
        if self.pins is not None and pins:
            self.pins.learn_many(pins)

    def snapshot(self) -> list[list[Any]]:
        """This replica's live pins for its snapshot answer."""
        if self.pins is None:
            return []
        return [[s, w, r, round(age, 3)] for s, w, r, age in self.pins.snapshot()]

    def _reject(self, iid: int, why: str) -> bool:
        self._m.errors.labels(self._model).inc()
        self._bad.note("session_pin", "router replica %x: %s", iid, why)
        return False
