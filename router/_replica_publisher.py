"""``ReplicaPublisher``: one router's side of replica sync (``router/replica_sync.py``), its
routing decisions published in sequence on its PUB socket, and its requests still in flight
for the snapshots its peers ask for (``router/_replica_snapshot.py``)."""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING, Any

import zmq

from dynamo_zmq.transport import BadInput

from ._replica_metrics import ReplicaMetrics
from ._replica_snapshot import OwnRequests
from ._replica_wire import (
    ADD,
    FREE,
    KINDS,
    PREFILLED,
    REPLICA_TOPIC,
    REPLICA_VERSION,
    ReplicaEvent,
    encode_event,
    pack_hashes,
)
from .scheduler import Route

if TYPE_CHECKING:
    from ._replica_sessions import ReplicaPins

__all__ = ["ReplicaPublisher"]

log = logging.getLogger(__name__)


class ReplicaPublisher:
    """Publishes one router's decisions (on ``sock`` once it is bound, as ``replica``)."""

    def __init__(self, model: str, metrics: ReplicaMetrics) -> None:
        self._model = model
        self._m = metrics
        self._ids = itertools.count(1)
        self._own = OwnRequests()
        self._bad = BadInput(log)
        self.seq = 0  # the next event's sequence number
        self.replica = 0  # the router's instance id
        self.sock: zmq.Socket[bytes] | None = None
        #: The router's session pins, in its snapshots (None: it pins none).
        self.pins: ReplicaPins | None = None

    def added(self, route: Route, prefill_tokens: int, lora: str | None = None) -> int:
        """This router routed a request (``route``, under adapter ``lora``): tell the peers;
        returns its id."""
        rid = next(self._ids)
        worker, rank = route.candidate
        entry = (worker, rank, pack_hashes(route.hashes), route.extra, prefill_tokens)
        self._own.add(rid, entry)
        self._publish(ADD, rid, *entry, lora=lora or "")
        return rid

    def prefilled(self, rid: int) -> None:
        self._own.prefilled(rid)
        self._publish(PREFILLED, rid)

    def freed(self, rid: int) -> None:
        self._own.free(rid)
        self._publish(FREE, rid)

    def snapshot(self) -> dict[str, Any]:
        """The requests in flight, as of the last event published (and the session pins)."""
        snap = self._own.snapshot(self.seq - 1)
        if self.pins is not None:
            snap["sessions"] = self.pins.snapshot()
        return snap

    def send(self, topic: bytes, payload: bytes) -> None:
        """Publish one message outside the sequenced events (a session pin)."""
        if self.sock is None:
            return
        try:
            self.sock.send_multipart([topic, payload], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a full queue: the session's next request sends it again
            self._bad.note("replica_send", "session pin not sent: %s", exc)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None

    def _publish(self, kind: int, rid: int, worker: int = 0, rank: int = 0, hashes: bytes = b"",
                 extra: int = 0, prefill: int = 0, lora: str = "") -> None:
        if self.sock is None:
            return
        ev = ReplicaEvent(REPLICA_VERSION, kind, self.replica, self.seq, rid, worker, rank,
                          hashes, extra, prefill, lora)
        try:
            self.sock.send_multipart([REPLICA_TOPIC, encode_event(ev)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a full queue: peers see a gap and ask for a snapshot
            self._bad.note("replica_send", "replica event not sent: %s", exc)
        self.seq += 1
        self._m.sent.labels(self._model, KINDS[kind]).inc()
