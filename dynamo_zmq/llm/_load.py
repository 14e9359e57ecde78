"""Worker load reports: what a worker's engine holds now, published for KV routers.

A worker whose engine implements ``LLMEngine.load()`` binds a ZMQ PUB socket and reads the
load every ``--load-interval`` seconds; it publishes a report when the load changed since the
last one, and otherwise every ``LOAD_HEARTBEAT`` seconds (an idle fleet of 256 workers then
sends each router about 128 reports a second, not 2,560). A report is one message of two
frames, ``[b"load", payload]``. The
payload is the MessagePack array of a ``LoadReport``::

    [version, instance_id, seq, ts, [[dp_rank, active_blocks, total_blocks, num_running,
                                      num_waiting], ...]]

The endpoint is advertised in the metadata of the worker's generate endpoint as
``load_endpoint``, beside the engine's ``kv_events_endpoint``. A report is state, not an event:
a subscriber that misses some loses nothing but freshness, so there is no replay.
``docs/wire.md`` has the details.
"""

from __future__ import annotations

import msgspec

from ._messages import EngineLoad

__all__ = [
    "LOAD_HEARTBEAT",
    "LOAD_TOPIC",
    "LOAD_VERSION",
    "MAX_LOAD_INTERVAL",
    "LoadDecodeError",
    "LoadReport",
    "decode_report",
    "encode_report",
]

#: Bumped when the report's layout changes incompatibly; receivers reject other versions.
LOAD_VERSION = 1
#: First frame of every load message.
LOAD_TOPIC = b"load"
#: Longest allowed ``--load-interval``: routers treat a report as current for 5 s by default
#: (``--load-report-ttl``, which must exceed this), so slower reports would expire between sends.
MAX_LOAD_INTERVAL = 2.0
#: Seconds between two reports of an unchanged load: fresh within the routers' TTL (5 s).
LOAD_HEARTBEAT = MAX_LOAD_INTERVAL
#: Largest load report decoded: a rank takes under 40 bytes, so this is thousands of ranks.
MAX_REPORT_BYTES = 1 << 20


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
