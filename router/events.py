"""Decoding of engines' KV-event batches into typed structs.

A KV-event message is ZMQ frames ``[topic, seq (8 bytes big-endian), payload]``; this module
decodes the payload, a MessagePack array ``[ts, [events...], dp_rank]``. Accepted forms:

* vLLM (current): events are maps tagged by ``"type"``: ``{"type": "BlockStored",
  "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", ...}``,
  ``{"type": "BlockRemoved", "block_hashes", "medium"}``, ``{"type": "AllBlocksCleared"}``.
  Unknown keys (``group_idx``, ``kv_cache_spec_kind``...) are ignored.
* vLLM (older) and SGLang: tagged arrays ``["BlockStored", block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium]``, ``["BlockRemoved", block_hashes, medium]``,
  ``["AllBlocksCleared"]``; trailing fields may be missing (defaults) or extra (ignored).
  SGLang's batch rank may be nil or missing (``dp_rank`` is then ``None``).

Engine block hashes arrive as ints (uint64, or SGLang's signed int64) or as bytes (vLLM's full
32-byte digests with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``). Every one is normalized to a
Python int in ``[0, 2**64)``: ints are masked to 64 bits (two's complement), bytes are hashed with
xxh3_64 (distinct digests stay distinct up to a 2**-64 collision chance). An engine always uses
one form, so its parent/child and store/remove hashes still agree.

Fast path: one msgspec decode straight into the public structs (map form, int hashes); the
other forms fall back to further typed decoders. Token ids are decoded as plain ints: checking
their uint32 range here would cost ~10% of the decode, and the indexer checks it anyway while
packing them for hashing (an out-of-range id makes it ignore that event). Anything that is not a
valid batch raises ``EventDecodeError``; nothing else escapes ``decode_batch``. An event of an
unknown type fails the whole batch (applying the rest could leave the index wrong).

Edge-hashed events: our own workers add ``own_hashes`` to each ``BlockStored`` (the router's
chained hashes, ``router.hashing``) and declare the scheme in their advert. ``decode_batch``
drops them (a publisher the router does not trust to hash as it does gets its tokens hashed);
``decode_edge_batch``, used only for publishers whose declared scheme matches, keeps them and
skips ``token_ids`` undecoded (msgspec steps over the array without building ints), so a
64-block store costs a handful of integers per block instead of its thousands of token ids.
"""

from __future__ import annotations

from typing import Any

import msgspec
import xxhash

from dynamo_zmq.llm import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockSize,
    BlockStored,
    EventBatch,
    KvEvent,
    OwnBatch,
    encode_batch,
)

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventDecodeError",
    "KvEvent",
    "OwnBatch",
    "decode_batch",
    "decode_edge_batch",
    "encode_batch",
    "normalize_hash",
]

_MASK64 = (1 << 64) - 1


class EventDecodeError(ValueError):
    """A payload is not a KV-event batch in any accepted form."""

    def __repr__(self) -> str:
        return f"EventDecodeError({str(self)!r})"


# --- fallback wire forms -------------------------------------------------------------------------

#: Engine hash on the wire: msgspec ints span int64 and uint64; normalized after decoding.
_AnyHash = int | bytes


class _ArrStored(msgspec.Struct, array_like=True, tag="BlockStored", gc=False):
    block_hashes: list[_AnyHash]
    parent_block_hash: _AnyHash | None
    token_ids: list[int]
    block_size: BlockSize
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None


class _ArrRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved", gc=False):
    block_hashes: list[_AnyHash]
    medium: str | None = MEDIUM_GPU


class _ArrCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared", gc=False):
    pass


class _ArrBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_ArrStored | _ArrRemoved | _ArrCleared]
    dp_rank: int | None = None


class _AnyStored(msgspec.Struct, tag_field="type", tag="BlockStored", gc=False):
    block_hashes: list[_AnyHash]
    parent_block_hash: _AnyHash | None
    token_ids: list[int]
    block_size: BlockSize
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[Any] | None = None


class _AnyRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved", gc=False):
    block_hashes: list[_AnyHash]
    medium: str | None = MEDIUM_GPU


class _AnyMapBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_AnyStored | _AnyRemoved | AllBlocksCleared]
    dp_rank: int | None = None


_fast = msgspec.msgpack.Decoder(EventBatch)
_arr = msgspec.msgpack.Decoder(_ArrBatch)
_any_map = msgspec.msgpack.Decoder(_AnyMapBatch)
_h64 = xxhash.xxh3_64_intdigest
_CLEARED = AllBlocksCleared()


def normalize_hash(h: int | bytes) -> int:
    """An engine block hash as an int in ``[0, 2**64)`` (see the module docstring)."""
    if type(h) is int:
        return h & _MASK64
    if isinstance(h, (bytes, bytearray, memoryview)):
        return _h64(h)
    raise EventDecodeError(f"block hash must be int or bytes, got {type(h).__name__}")


def _norm_list(hashes: list[Any]) -> list[int]:
    return [h & _MASK64 if type(h) is int else _h64(h) for h in hashes]


def _norm_opt(h: Any) -> int | None:
    return None if h is None else normalize_hash(h)


def _fix_signed(batch: EventBatch, keep_own: bool = False) -> EventBatch:
    """Mask negative (int64) hashes of a fast-path batch (a no-op for uint64 engines); drop any
    ``own_hashes`` unless ``keep_own`` (trusted only through ``decode_edge_batch``)."""
    for ev in batch.events:
        if type(ev) is BlockStored:
            owns = ev.own_hashes
            if owns is not None:
                if not keep_own:
                    ev.own_hashes = None
                elif owns and min(owns) < 0:
                    ev.own_hashes = _norm_list(owns)
            if ev.block_hashes and min(ev.block_hashes) < 0:
                ev.block_hashes = _norm_list(ev.block_hashes)
            p = ev.parent_block_hash
            if p is not None and p < 0:
                ev.parent_block_hash = p & _MASK64
        elif type(ev) is BlockRemoved and ev.block_hashes and min(ev.block_hashes) < 0:
            ev.block_hashes = _norm_list(ev.block_hashes)
    return batch


def _from_fallback(ts: float, events: list[Any], dp_rank: int | None) -> EventBatch:
    out: list[KvEvent] = []
    for ev in events:
        if isinstance(ev, (_ArrStored, _AnyStored)):
            out.append(BlockStored(
                _norm_list(ev.block_hashes), _norm_opt(ev.parent_block_hash), ev.token_ids,
                ev.block_size, ev.lora_id, ev.medium, ev.lora_name,
                getattr(ev, "extra_keys", None),
            ))
        elif isinstance(ev, (_ArrRemoved, _AnyRemoved)):
            out.append(BlockRemoved(_norm_list(ev.block_hashes), ev.medium))
        else:
            out.append(_CLEARED)
    return EventBatch(ts, out, dp_rank)


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one KV-event payload (frame 3 of ``[topic, seq, payload]``).

    Args:
        payload: the MessagePack payload, in any form listed in the module docstring.

    Returns:
        The batch, with every engine hash normalized to a uint64 int.

    Raises:
        EventDecodeError: the payload is not a valid batch (the only exception raised).
    """
    try:
        return _fix_signed(_fast.decode(payload))
    except msgspec.ValidationError as exc:
        first: Exception = exc
    except (msgspec.DecodeError, TypeError, ValueError, RecursionError, MemoryError) as exc:
        raise EventDecodeError(f"malformed KV-event payload: {exc}") from exc
    # Tagged arrays (SGLang, older vLLM), then maps with bytes hashes.
    for decoder in (_arr, _any_map):
        try:
            b = decoder.decode(payload)
        except (msgspec.DecodeError, TypeError, ValueError, RecursionError, MemoryError):
            continue
        try:
            return _from_fallback(b.ts, b.events, b.dp_rank)
        except (TypeError, ValueError, OverflowError) as exc:  # pragma: no cover - defensive
            raise EventDecodeError(f"bad KV-event hashes: {exc}") from exc
    raise EventDecodeError(f"not a KV-event batch: {first}") from first


# --- edge-hashed events --------------------------------------------------------------------------


class _EdgeStored(msgspec.Struct, tag_field="type", tag="BlockStored", gc=False):
    """A ``BlockStored`` without its ``token_ids`` (skipped by the decoder, never built)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    block_size: BlockSize
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    own_hashes: list[int] | None = None


class _EdgeBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_EdgeStored | BlockRemoved | AllBlocksCleared]
    dp_rank: int | None = None


_edge = msgspec.msgpack.Decoder(_EdgeBatch)
#: Payloads up to this size (a one-block store) are decoded whole, token ids included: decoding
#: a few dozen ints costs less than rebuilding the events without them.
SMALL_BATCH_BYTES = 768


def _decode_small(payload: bytes) -> tuple[EventBatch, int]:
    try:
        batch = _fast.decode(payload)
    except (msgspec.DecodeError, TypeError, ValueError, RecursionError, MemoryError):
        return decode_batch(payload), 0
    edge = 0
    for ev in batch.events:
        if type(ev) is BlockStored:
            owns = ev.own_hashes
            if owns is None or len(owns) != len(ev.block_hashes):
                return _fix_signed(batch), 0
            edge += len(owns)
    return _fix_signed(batch, keep_own=True), edge


def decode_edge_batch(payload: bytes) -> tuple[EventBatch, int]:
    """Decode a payload from a publisher that hashes at the edge with the router's scheme.

    Each ``BlockStored`` comes back with its ``own_hashes`` and empty ``token_ids`` (a small
    batch, up to ``SMALL_BATCH_BYTES``, keeps its decoded token ids; they are not hashed). A batch
    that is not in that form (a store without ``own_hashes``, or with not one per block, or
    another wire form) is decoded by ``decode_batch`` instead, so it is indexed from its tokens.

    Returns:
        The batch and how many blocks it stores with edge hashes (0 when it took the token path).

    Raises:
        EventDecodeError: the payload is not a valid batch.
    """
    if len(payload) <= SMALL_BATCH_BYTES:
        return _decode_small(payload)
    try:
        b = _edge.decode(payload)
    except (msgspec.DecodeError, TypeError, ValueError, RecursionError, MemoryError):
        return decode_batch(payload), 0
    out: list[KvEvent] = []
    edge = 0
    for ev in b.events:
        if type(ev) is _EdgeStored:
            owns, hashes = ev.own_hashes, ev.block_hashes
            if owns is None or len(owns) != len(hashes):
                return decode_batch(payload), 0
            edge += len(owns)
            out.append(BlockStored(hashes, ev.parent_block_hash, [], ev.block_size, ev.lora_id,
                                   ev.medium, ev.lora_name, ev.extra_keys, owns))
        else:
            out.append(ev)  # type: ignore[arg-type]  # BlockRemoved or AllBlocksCleared
    return _fix_signed(EventBatch(b.ts, out, b.dp_rank), keep_own=True), edge
