"""Worker load reports: what a worker's engine holds now, published for KV routers.

A worker whose engine implements ``LLMEngine.load()`` binds a ZMQ PUB socket and every
``--load-interval`` seconds publishes one message of two frames, ``[b"load", payload]``. The
payload is the MessagePack array of a ``LoadReport``::

    [version, instance_id, seq, ts, [[dp_rank, active_blocks, total_blocks, num_running,
                                      num_waiting], ...]]

The endpoint is advertised in the metadata of the worker's generate endpoint as
``load_endpoint``, beside the engine's ``kv_events_endpoint``. A report is state, not an event:
a subscriber that misses some loses nothing but freshness, so there is no replay.
``docs/wire.md`` has the details.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from .engine import EngineLoad
from .transport import make_socket

__all__ = [
    "LOAD_TOPIC",
    "LOAD_VERSION",
    "MAX_LOAD_INTERVAL",
    "LoadDecodeError",
    "LoadPublisher",
    "LoadReport",
    "decode_report",
    "encode_report",
]

log = logging.getLogger(__name__)

#: Bumped when the report's layout changes incompatibly; receivers reject other versions.
LOAD_VERSION = 1
#: First frame of every load message.
LOAD_TOPIC = b"load"
#: Longest allowed ``--load-interval``: routers treat a report as current for 5 s by default
#: (``--load-report-ttl``, which must exceed this), so slower reports would expire between sends.
MAX_LOAD_INTERVAL = 2.0
#: Largest load report decoded: a rank takes under 40 bytes, so this is thousands of ranks.
MAX_REPORT_BYTES = 1 << 20
#: Messages a PUB socket queues per subscriber: a report is stale soon, so keep few.
PUB_HWM = 1000


class LoadReport(msgspec.Struct, array_like=True, gc=False):
    """One published load message: every rank of one worker at one moment."""

    version: int
    #: The publishing worker's instance id (receivers check it is the worker they follow).
    instance_id: int
    #: Counts the worker's reports from 0; a receiver skips one not newer than the last.
    seq: int
    #: Unix time the numbers were read.
    ts: float
    ranks: list[EngineLoad]


class _Head(msgspec.Struct, array_like=True, gc=False):
    version: int


class LoadDecodeError(ValueError):
    """A load message that is malformed, of another version, or fails validation."""


_encoder = msgspec.msgpack.Encoder()
_head_decoder = msgspec.msgpack.Decoder(_Head)
_decoder = msgspec.msgpack.Decoder(LoadReport)


def encode_report(report: LoadReport) -> bytes:
    """The payload frame of ``report``."""
    return _encoder.encode(report)


def decode_report(payload: bytes) -> LoadReport:
    """Decode and validate one payload frame.

    Raises:
        LoadDecodeError: anything else than a valid report of ``LOAD_VERSION``, or a payload
            over ``MAX_REPORT_BYTES`` (not decoded at all).
    """
    if len(payload) > MAX_REPORT_BYTES:
        raise LoadDecodeError(f"load report of {len(payload)} bytes, over {MAX_REPORT_BYTES}")
    try:
        version = _head_decoder.decode(payload).version
        if version != LOAD_VERSION:
            raise LoadDecodeError(f"load report version {version}, expected {LOAD_VERSION}")
        return _decoder.decode(payload)
    except (msgspec.MsgspecError, RecursionError) as exc:
        raise LoadDecodeError(f"malformed load report: {exc}") from exc


class LoadPublisher:
    """Publishes an engine's ``load()`` on a PUB socket every ``interval`` seconds; owns the
    socket, its ZMQ context and the task.

    Args:
        source: ``engine.load`` (a list of ranks; None or empty: nothing to send this time).
        instance_id: the worker's instance id, sent in every report.
        bind: ``tcp://HOST:PORT`` to bind (port 0: any free one).
        interval: seconds between two reports (> 0).
    """

    def __init__(
        self, source: Callable[[], list[EngineLoad] | None], instance_id: int, bind: str, interval: float
    ) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        self._source = source
        self.instance_id = instance_id
        self._bind = bind
        self.interval = interval
        self.port = 0
        #: Reports sent so far (the next report's seq).
        self.sent = 0
        self._zctx: zmq.Context[Any] | None = None
        self._pub: zmq.Socket[Any] | None = None
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    async def start(self) -> None:
        """Bind the socket and start publishing."""
        if self._zctx is not None:
            raise RuntimeError("load publisher already started")
        self._zctx = zmq.Context(io_threads=1)
        try:
            self._pub = make_socket(self._zctx, zmq.PUB, bind=self._bind, hwm=PUB_HWM)
            endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT)
            self.port = int(endpoint.decode().rsplit(":", 1)[1])  # type: ignore[union-attr]
        except BaseException:
            await self.close()
            raise
        self._task = asyncio.create_task(self._run(), name="worker-load-publisher")

    def publish(self) -> bool:
        """Read the engine's load and send one report now; False if there was nothing to send
        (no ranks, the engine failed, or the socket's queue is full)."""
        try:
            ranks = self._source()
        except Exception:
            if not self._failing:  # once per failing streak, not every interval
                log.exception("engine load() failed; no load report until it works again")
            self._failing = True
            return False
        self._failing = False
        if not ranks or self._pub is None:
            return False
        report = LoadReport(LOAD_VERSION, self.instance_id, self.sent, time.time(), list(ranks))
        try:
            self._pub.send_multipart([LOAD_TOPIC, encode_report(report)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if not isinstance(exc, zmq.Again):
                log.warning("load report not sent: %s", exc)
            return False
        self.sent += 1
        return True

    async def _run(self) -> None:
        while True:
            self.publish()
            await asyncio.sleep(self.interval)

    async def close(self) -> None:
        """Stop publishing and close the socket (idempotent)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None
        if self._zctx is not None:
            self._zctx.term()
            self._zctx = None
