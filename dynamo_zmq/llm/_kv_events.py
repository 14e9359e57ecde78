"""KV-cache events in vLLM's wire format: one definition for the engines that publish them and
the routers that read them.

A published message is ``[topic, seq as 8-byte big-endian, payload]``; the payload is the
MessagePack array ``[ts, events, dp_rank]`` and each event a map tagged by ``"type"``
(``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``), as vLLM 0.32 sends them.

Own-hash deltas (our extension, ``KvHashScheme.form == "deltas"``): a worker that hashes at the
edge and keeps its own per-rank bookkeeping publishes ``OwnBatch`` payloads instead, in the same
``[ts, events, dp_rank]`` shape, whose events are ``OwnStored`` / ``OwnRemoved`` (the router's
own hashes that entered / left the rank, each counted once however many engine blocks map to it)
and ``AllBlocksCleared``. The router's store is then one dict update per event: no token ids,
no engine hashes, no parent chains. docs/wire.md ("KV events: own-hash deltas") is the contract.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import msgspec

__all__ = [
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockSize",
    "BlockStored",
    "EventBatch",
    "KvEvent",
    "OwnBatch",
    "OwnEvent",
    "OwnRemoved",
    "OwnStored",
    "encode_batch",
    "encode_own_batch",
]

BlockSize = Annotated[int, msgspec.Meta(gt=0)]
MEDIUM_GPU = "GPU"


class BlockStored(msgspec.Struct, tag_field="type", tag="BlockStored", gc=False):
    """Full blocks that entered an engine's prefix cache; ``token_ids`` concatenates the tokens
    of all of them (``len(block_hashes) * block_size`` when well-formed). Hashes are uint64."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: BlockSize
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    #: Per block: ``None`` or the engine's extra hash inputs (multimodal hashes, cache salt...).
    extra_keys: list[Any] | None = None
    #: Per block: the router's own chained hash (``KvHashScheme``), from workers that hash at
    #: the edge; ``None`` from engines that do not (vLLM, SGLang). Routers that know the
    #: worker's declared scheme use these and skip ``token_ids``; others ignore them.
    own_hashes: list[int] | None = None


class BlockRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved", gc=False):
    """Blocks evicted from an engine's prefix cache. Hashes are uint64."""

    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU


class AllBlocksCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared", gc=False):
    """The engine (this DP rank) dropped its whole prefix cache."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """One published payload: the events of one scheduler step of one data-parallel rank.

    ``dp_rank`` is ``None`` when an engine sends none (SGLang without attention DP).
    """

    ts: float
    events: list[KvEvent]
    dp_rank: int | None = None


class OwnStored(msgspec.Struct, tag_field="type", tag="OwnStored", gc=False):
    """Own hashes (``KvHashScheme``, uint64) that entered this rank's cache: each one's first
    reference on the rank, parents before children. ``holes``: after this event, how many own
    hashes the rank holds whose parent own hash it does not hold (0 means every held block's
    whole prefix is held)."""

    own_hashes: list[int]
    holes: int = 0


class OwnRemoved(msgspec.Struct, tag_field="type", tag="OwnRemoved", gc=False):
    """Own hashes whose last reference left this rank's cache; ``holes`` as in ``OwnStored``."""

    own_hashes: list[int]
    holes: int = 0


OwnEvent = OwnStored | OwnRemoved | AllBlocksCleared


class OwnBatch(msgspec.Struct, array_like=True, gc=False):
    """A payload of a publisher whose declared form is ``"deltas"`` (see the module docstring)."""

    ts: float
    events: list[OwnEvent]
    dp_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()


def encode_batch(events: list[KvEvent], dp_rank: int | None = 0, ts: float | None = None) -> bytes:
    """The payload frame of one message (``ts`` defaults to now)."""
    return _encoder.encode(EventBatch(time.time() if ts is None else ts, events, dp_rank))


def encode_own_batch(events: list[OwnEvent], dp_rank: int | None = 0,
                     ts: float | None = None) -> bytes:
    """The payload frame of one own-hash-delta message (``ts`` defaults to now)."""
    return _encoder.encode(OwnBatch(time.time() if ts is None else ts, events, dp_rank))
