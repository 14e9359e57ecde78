"""``LoadPublisher``: the worker side of load reports (their format is ``dynamo_zmq.llm``'s
``LoadReport``): reads the engine's ``load()`` every interval and publishes it on a PUB socket
when it changed, or when the last report is a heartbeat old (``LOAD_HEARTBEAT``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import zmq

from ..llm import LOAD_HEARTBEAT, LOAD_TOPIC, LOAD_VERSION, EngineLoad, LoadReport, encode_report
from ..resources import Resources
from ..transport import Domain, make_socket

__all__ = ["PUB_HWM", "LoadPublisher"]

log = logging.getLogger(__name__)

#: Messages a PUB socket queues per subscriber: a report is stale soon, so keep few.
PUB_HWM = 1000


class LoadPublisher:
    """Publishes an engine's ``load()`` on a PUB socket; owns the socket and the task.

    Every ``interval`` seconds it reads the load and sends a report if the load changed since
    the last report or that report is ``heartbeat`` seconds old: a busy worker reports every
    interval, an idle one every heartbeat (``tick``).

    Args:
        source: ``engine.load`` (a list of ranks; None or empty: nothing to send this time).
        instance_id: the worker's instance id, sent in every report.
        bind: ``tcp://HOST:PORT`` to bind (port 0: any free one).
        interval: seconds between two reads of the load (> 0).
        heartbeat: seconds after which an unchanged load is sent again.
        resources: the owner it belongs to (closing that closes the publisher too); default
            a ``Resources`` of its own.
    """

    def __init__(
        self,
        source: Callable[[], list[EngineLoad] | None],
        instance_id: int,
        bind: str,
        interval: float,
        *,
        heartbeat: float = LOAD_HEARTBEAT,
        resources: Resources | None = None,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        self._source = source
        self.instance_id = instance_id
        self._bind = bind
        self.interval = interval
        self.heartbeat = heartbeat
        self.port = 0
        #: Reports sent so far (the next report's seq).
        self.sent = 0
        owner = resources if resources is not None else Resources()
        self._res = owner.child("load-publisher")
        self._pub: zmq.Socket[bytes] | None = None
        self._failing = False
        #: The ranks of the last report sent, and when (monotonic): what ``tick`` compares.
        self._last: list[EngineLoad] | None = None
        self._last_at = -float("inf")

    async def start(self) -> None:
        """Bind the socket and start publishing."""
        if self._pub is not None:
            raise RuntimeError("load publisher already started")
        self._pub = make_socket(self._res.zctx, zmq.PUB, bind=self._bind, hwm=PUB_HWM,
                                zap_domain=Domain.LOAD)
        self._res.on_close(self._close_socket)
        endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.port = int(endpoint.rsplit(":", 1)[1])
        self._res.spawn(self._run(), "worker-load-publisher")

    def publish(self) -> bool:
        """Read the engine's load and send one report now; False if there was nothing to send
        (no ranks, the engine failed, or the socket's queue is full)."""
        ranks = self._read()
        return ranks is not None and self._send(ranks, time.monotonic())

    def tick(self, now: float | None = None) -> bool:
        """Read the engine's load and send it if it changed since the last report or the
        heartbeat is due (``now``: monotonic seconds, default the clock's); True if sent."""
        now = time.monotonic() if now is None else now
        ranks = self._read()
        if ranks is None or (ranks == self._last and now - self._last_at < self.heartbeat):
            return False
        return self._send(ranks, now)

    def _read(self) -> list[EngineLoad] | None:
        try:
            ranks = self._source()
        except Exception:
            if not self._failing:  # once per failing streak, not every interval
                log.exception("engine load() failed; no load report until it works again")
            self._failing = True
            return None
        self._failing = False
        return list(ranks) if ranks else None

    def _send(self, ranks: list[EngineLoad], now: float) -> bool:
        if self._pub is None:
            return False
        report = LoadReport(LOAD_VERSION, self.instance_id, self.sent, time.time(), ranks)
        try:
            self._pub.send_multipart([LOAD_TOPIC, encode_report(report)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if not isinstance(exc, zmq.Again):
                log.warning("load report not sent: %s", exc)
            return False
        self.sent += 1
        self._last, self._last_at = ranks, now
        return True

    async def _run(self) -> None:
        while True:
            self.tick()
            await asyncio.sleep(self.interval)

    async def close(self) -> None:
        """Stop publishing and close the socket (idempotent)."""
        await self._res.close()

    def _close_socket(self) -> None:
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None
