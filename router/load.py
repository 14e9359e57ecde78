"""``LoadSubscriber``: one worker's published load (``dynamo_zmq.load``) into the router.

A SUB socket connects to the worker's ``load_endpoint``; each valid report hands every rank's
``active_blocks`` to a callback (``KvRouter`` passes them to ``LoadTracker.report``, where they
replace the router's own prediction for a while). Decoding is defensive: a message with the
wrong frames, an undecodable or invalid payload, another version, another instance id or a rank
the worker does not have is counted, logged (rate-limited) and skipped; nothing a publisher
sends can stop the loop. A report not newer (by ``seq``) than the last one applied is skipped.

Each report is handed on with when it was measured, on this process's monotonic clock
(``ReportClock``), so the router can take off it the requests that finished here after it was
measured (``LoadTracker.report``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

import zmq

from dynamo_zmq.llm import LOAD_TOPIC, EngineLoad, LoadDecodeError, decode_report
from dynamo_zmq.resources import Resources
from dynamo_zmq.transport import AsyncSocket, make_socket, peer_key

from .metrics import RouterMetrics

__all__ = ["LoadStats", "LoadSubscriber", "OnLoad", "ReportClock"]

log = logging.getLogger(__name__)

#: Receives one worker's ranks: ``on_load(worker_id, ranks, measured_at)`` (``measured_at`` on
#: ``time.monotonic``'s clock, or None when the report's timestamp is unusable).
OnLoad = Callable[[int, list[EngineLoad], "float | None"], object]
#: Receive high-water mark: reports go stale quickly, a backlog is worth nothing.
SUB_HWM = 1000
#: Seconds between two warnings about one worker's bad messages.
WARN_EVERY = 10.0


class ReportClock:
    """When one worker's reports were measured, on this process's monotonic clock.

    A report carries the worker's Unix time ``ts``; ``arrival - ts`` is its trip plus the offset
    between the two hosts' clocks. The smallest recent value stands for the offset plus the
    quickest trip, so a report's excess over it is how long it was held up (on the wire, in a
    queue, behind other work in this process). The offset cancels out whatever it is; the
    minimum is taken over the last ``window`` to ``2 * window`` seconds only, so clock drift and
    steps are forgotten.
    """

    def __init__(
        self,
        window: float = 10.0,
        wall: Callable[[], float] = time.time,
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        self._window = window
        self._wall = wall
        self._mono = mono
        self._floor = self._last_floor = math.inf
        self._since = mono()

    def measured_at(self, ts: float) -> float | None:
        """This process's monotonic time at which a report stamped ``ts`` was measured (None
        if ``ts`` is not a finite number)."""
        delay = self._wall() - ts
        if not math.isfinite(delay):
            return None
        now = self._mono()
        if now - self._since >= self._window:
            self._last_floor, self._floor, self._since = self._floor, math.inf, now
        self._floor = min(self._floor, delay)
        return now - (delay - min(self._floor, self._last_floor))


class LoadStats:
    """Plain counters of one load subscriber."""

    __slots__ = ("applied", "decode_errors", "received", "stale")

    def __init__(self) -> None:
        #: Messages received on the SUB socket.
        self.received = 0
        #: Reports handed to the callback.
        self.applied = 0
        #: Messages (or ranks in them) rejected as malformed.
        self.decode_errors = 0
        #: Reports skipped because a newer one was already applied.
        self.stale = 0

    def __repr__(self) -> str:
        return "LoadStats(" + ", ".join(f"{k}={getattr(self, k)}" for k in self.__slots__) + ")"


class LoadSubscriber:
    """Follows one worker's load reports.

    Args:
        owner: the resources this subscriber's task and socket hang under (the router's).
        worker_id: the worker's instance id (reports naming another are rejected).
        endpoint: the worker's advertised ``load_endpoint``.
        on_load: called with ``(worker_id, ranks)`` for each valid report.
        dp_size: the worker's data-parallel size (ranks outside it are rejected).
        metrics: shared router metrics; ``model`` labels them.
    """

    def __init__(
        self,
        owner: Resources,
        worker_id: int,
        endpoint: str,
        on_load: OnLoad,
        *,
        dp_size: int = 1,
        metrics: RouterMetrics | None = None,
        model: str = "",
    ) -> None:
        self._owner = owner
        self._res: Resources | None = None
        self.worker_id = worker_id
        self.endpoint = endpoint
        self._on_load = on_load
        self.dp_size = dp_size
        self._metrics = metrics
        self._model = model
        # The model's series, looked up once (a label lookup per report adds up at 256 workers)
        self._applied = metrics.load_reports.labels(model) if metrics is not None else None
        self._bytes = metrics.load_report_bytes.labels(model) if metrics is not None else None
        self.stats = LoadStats()
        self.clock = ReportClock()
        #: Seq of the last report applied (None: none yet).
        self.last_seq: int | None = None
        self._sock: AsyncSocket | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._warned_at = -WARN_EVERY

    def __repr__(self) -> str:
        return f"LoadSubscriber({self.worker_id:x}, {self.endpoint}, {self.stats})"

    def start(self) -> None:
        """Connect and start following (needs a running event loop; returns at once)."""
        if self._sock is not None or self._closed:
            raise RuntimeError("load subscriber already started or closed")
        sock = make_socket(self._owner.zctx, zmq.SUB, hwm=SUB_HWM, heartbeat_ms=0,
                           server_key=peer_key(self.worker_id))
        try:
            sock.setsockopt(zmq.SUBSCRIBE, LOAD_TOPIC)
            sock.connect(self.endpoint)
            self._sock = async_sock = AsyncSocket(sock)
        except BaseException:
            sock.close(linger=0)
            raise
        self._res = res = self._owner.child(f"load {self.worker_id:x}")
        res.on_close(async_sock.close)  # after the task has ended
        self._task = res.spawn(self._run(), f"load-{self.worker_id:x}")

    async def close(self) -> None:
        """Stop following (idempotent); no report is delivered once this is called."""
        if self._closed:
            return
        self._closed = True
        self._task = None
        if self._res is not None:
            await self._res.close()

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        # drain_forever logs a callback's failure; the next report may do better
        await sock.drain_forever(self.handle, f"worker {self.worker_id:x}'s load reports")

    def handle(self, frames: list[bytes]) -> bool:
        """Apply one message's frames; False if it was rejected or stale. Never raises for
        anything a publisher can send."""
        if self._closed:
            return False
        self.stats.received += 1
        if self._bytes is not None:
            self._bytes.inc(sum(map(len, frames)))
        if len(frames) != 2 or frames[0] != LOAD_TOPIC:
            return self._reject("malformed load message (%d frames)", len(frames))
        try:
            report = decode_report(frames[1])
        except LoadDecodeError as exc:
            return self._reject("%s", exc)
        if report.instance_id != self.worker_id:
            return self._reject("load report from instance %x", report.instance_id)
        if self.last_seq is not None and report.seq <= self.last_seq:
            self.stats.stale += 1
            return False
        ranks = [r for r in report.ranks if r.dp_rank < self.dp_size]
        if len(ranks) != len(report.ranks):
            self._reject("load report names ranks beyond the worker's %d", self.dp_size)
        self.last_seq = report.seq
        self.stats.applied += 1
        if self._applied is not None:
            self._applied.inc()
        if ranks:
            self._on_load(self.worker_id, ranks, self.clock.measured_at(report.ts))
        return True

    def _reject(self, msg: str, *args: object) -> bool:
        self.stats.decode_errors += 1
        if self._metrics is not None:
            self._metrics.load_decode_errors.labels(self._model).inc()
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY:
            self._warned_at = now
            log.warning("worker %x: " + msg + " (%d rejected so far)", self.worker_id, *args,
                        self.stats.decode_errors)
        return False

