"""KV-cache events in vLLM's wire format (maps tagged by ``"type"``, batched as
``[ts, events, dp_rank]``), and their MessagePack encoding."""

from __future__ import annotations

import time

import msgspec

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KvEvent",
    "encode_batch",
]

MEDIUM_GPU = "GPU"


class BlockStored(msgspec.Struct, tag_field="type", tag="BlockStored", gc=False):
    """Full blocks that entered the prefix cache; ``token_ids`` concatenates all their tokens."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved", gc=False):
    """Cached blocks that were evicted."""

    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU


class AllBlocksCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared", gc=False):
    """The whole prefix cache was dropped."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """One published message: the events of one scheduler step of one data-parallel rank."""

    ts: float
    events: list[KvEvent]
    data_parallel_rank: int = 0


_encoder = msgspec.msgpack.Encoder()


def encode_batch(events: list[KvEvent], dp_rank: int, ts: float | None = None) -> bytes:
    """The payload frame of one KV-event message."""
    return _encoder.encode(EventBatch(time.time() if ts is None else ts, events, dp_rank))
