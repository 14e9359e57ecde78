"""Decoding of own-hash delta payloads (``KvHashScheme.form == "deltas"``, docs/wire.md).

A deltas publisher's payload is an ``OwnBatch``: ``[ts, [events...], dp_rank]`` whose events are
maps tagged ``"OwnStored"`` / ``"OwnRemoved"`` (``own_hashes``, ``holes``) or
``"AllBlocksCleared"``. One msgspec decode builds the public structs; a negative ``holes`` fails
the batch. Own hashes are taken as sent: the contract says uint64, and a negative one (a
publisher bug) is indexed harmlessly, since no prompt's hash is ever negative. Anything else
(garbage, another wire form, a wrong type, an unknown event) raises ``EventDecodeError``: a
deltas subscriber never falls back to the token path, since its publisher's payloads carry no
token ids.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from dynamo_zmq.llm import OwnBatch, OwnEvent, OwnRemoved, OwnStored

from .events import EventBatch, EventDecodeError, decode_batch, decode_edge_batch

__all__ = ["OwnBatch", "OwnEvent", "OwnRemoved", "OwnStored", "decode_own_batch",
           "pick_decoder"]

_decoder = msgspec.msgpack.Decoder(OwnBatch)


def decode_own_batch(payload: bytes) -> tuple[OwnBatch, int]:
    """Decode one own-hash delta payload.

    Returns:
        The batch and how many own hashes its ``OwnStored`` events store (the blocks indexed
        without token ids, counted like edge-hashed ones).

    Raises:
        EventDecodeError: the payload is not a valid ``OwnBatch`` (the only exception raised).
    """
    try:
        batch = _decoder.decode(payload)
    except (msgspec.DecodeError, TypeError, ValueError, RecursionError, MemoryError) as exc:
        raise EventDecodeError(f"not an own-hash delta batch: {exc}") from exc
    stored = 0
    for ev in batch.events:
        if type(ev) is OwnStored:
            stored += len(ev.own_hashes)
        elif type(ev) is not OwnRemoved:
            continue
        if ev.holes < 0:
            raise EventDecodeError(f"negative holes in an own-hash delta: {ev!r}")
    return batch, stored


Decoded = tuple[EventBatch | OwnBatch, int]


def _decode_tokens(payload: bytes) -> Decoded:
    return decode_batch(payload), 0


def pick_decoder(edge_hashed: bool, deltas: bool) -> Callable[[bytes], Decoded]:
    """The payload decoder of a subscriber: own-hash deltas (``deltas``, only with a usable
    scheme), edge-hashed stores (``edge_hashed``) or the token path. Each returns the batch and
    the blocks it stores without token ids, and raises only ``EventDecodeError``."""
    if edge_hashed and deltas:
        return decode_own_batch
    return decode_edge_batch if edge_hashed else _decode_tokens
