"""What KV-router replicas tell each other (``router/replica_sync.py``), on the wire.

Dynamo's router replica sync, over a PUB socket: each message is ``[REPLICA_TOPIC, payload]``,
the payload a MessagePack array (``ReplicaEvent``). A router publishes one event when it routes
a request (``ADD``: the (worker, rank), the prompt's block hashes packed as little-endian u64,
the expected output blocks, the prompt tokens left to prefill and its LoRA adapter, which
peers' residency predictions take), one when the request's
prompt is prefilled (``PREFILLED``) and one when it ends (``FREE``). ``seq`` counts a sender's
events from 0, so a receiver sees what it missed.
"""

from __future__ import annotations

import array
import sys
from typing import Any

import msgspec
import xxhash

from dynamo_zmq.transport import endpoint_via

__all__ = [
    "ADD",
    "FREE",
    "KINDS",
    "META_KEY",
    "PREFILLED",
    "REPLICA_TOPIC",
    "REPLICA_VERSION",
    "ReplicaDecodeError",
    "ReplicaEvent",
    "advertised_events",
    "decode_event",
    "encode_event",
    "pack_hashes",
    "replica_path",
    "unpack_hashes",
]

REPLICA_TOPIC = b"kv-replica"
#: The replica endpoint's metadata key.
META_KEY = "kv_router_replica"
REPLICA_VERSION = 1
ADD, PREFILLED, FREE = 0, 1, 2
#: Event kind -> metric label.
KINDS = {ADD: "add", PREFILLED: "prefilled", FREE: "free"}
#: Most block hashes one event may carry (a 1M-token prompt in 16-token blocks is 62,500).
MAX_HASHES = 1 << 18
#: Longest LoRA adapter name an event may carry.
MAX_LORA_NAME = 1024
_LITTLE = sys.byteorder == "little"
assert array.array("Q").itemsize == 8


class ReplicaEvent(msgspec.Struct, array_like=True, frozen=True):
    """One routing decision's step, as its router publishes it."""

    version: int
    kind: int
    #: The sending router's instance id and its event counter.
    replica: int
    seq: int
    #: The sender's id of the request (unique per sender).
    request: int
    worker: int = 0
    dp_rank: int = 0
    #: The prompt's block hashes, packed little-endian u64 (``ADD`` only).
    hashes: bytes = b""
    #: Expected output blocks (``ADD`` only).
    extra: int = 0
    #: Prompt tokens left to prefill (``ADD`` only; 0 without a prefill bound).
    prefill: int = 0
    #: The request's LoRA adapter (``ADD`` only; "": the base model).
    lora: str = ""


class ReplicaDecodeError(ValueError):
    """A payload that is not a valid ``ReplicaEvent``."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ReplicaEvent)


def encode_event(event: ReplicaEvent) -> bytes:
    return _encoder.encode(event)


def decode_event(payload: bytes) -> ReplicaEvent:
    """The event in ``payload``.

    Raises:
        ReplicaDecodeError: undecodable, another version, an unknown kind, negative or
            out-of-range fields, hashes not a whole number of u64s (or too many), or a LoRA
            name longer than ``MAX_LORA_NAME``.
    """
    try:
        ev = _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ReplicaDecodeError(f"undecodable replica event: {exc}") from None
    if ev.version != REPLICA_VERSION:
        raise ReplicaDecodeError(f"replica event version {ev.version}, not {REPLICA_VERSION}")
    if ev.kind not in KINDS:
        raise ReplicaDecodeError(f"unknown replica event kind {ev.kind}")
    if min(ev.replica, ev.seq, ev.request, ev.worker, ev.dp_rank, ev.extra, ev.prefill) < 0:
        raise ReplicaDecodeError("negative field in a replica event")
    if len(ev.hashes) % 8 or len(ev.hashes) > 8 * MAX_HASHES:
        raise ReplicaDecodeError(f"replica event hashes of {len(ev.hashes)} bytes")
    if len(ev.lora) > MAX_LORA_NAME:
        raise ReplicaDecodeError(f"replica event LoRA name of {len(ev.lora)} characters")
    return ev


def pack_hashes(hashes: list[int] | tuple[int, ...]) -> bytes:
    arr = array.array("Q", hashes)
    if not _LITTLE:  # pragma: no cover - big-endian hosts only
        arr.byteswap()
    return arr.tobytes()


def unpack_hashes(data: bytes) -> list[int]:
    arr = array.array("Q")
    arr.frombytes(data)
    if not _LITTLE:  # pragma: no cover - big-endian hosts only
        arr.byteswap()
    return arr.tolist()


def replica_path(client_path: str, model: str) -> str:
    """The endpoint the replicas of ``model``'s router on ``client_path`` advertise."""
    path = client_path.removeprefix("dyn://")
    key = xxhash.xxh3_64_hexdigest(f"{path}|{model}".encode())
    return f"{path.split('.')[0]}.kv-router.replica-{key}"


def advertised_events(desc: Any, dialed: str, path: str, model: str, client_path: str
                      ) -> str | None:
    """The replica events endpoint of ``model``'s router on ``client_path`` that the instance
    ``desc`` advertises on ``path`` (its ``META_KEY`` metadata), as dialed via ``dialed``."""
    for info in getattr(desc, "endpoints", ()):
        if info.path != path:
            continue
        meta = info.metadata.get(META_KEY)
        if (isinstance(meta, dict) and meta.get("model") == model
                and meta.get("path") == client_path and isinstance(meta.get("events"), str)):
            return endpoint_via(str(meta["events"]), dialed, desc.hosts)
    return None
