"""Hashing vLLM's KV events at the edge: the relay (``_relay.py``) adds the router's own block
hashes (``own_hashes``, ``KvHashScheme``) to each ``BlockStored`` it republishes, so routers
index them without decoding the token ids.

Per data-parallel rank, ``EdgeHasher`` keeps engine hash -> own hash for the blocks vLLM holds
(dropped on ``BlockRemoved`` and ``AllBlocksCleared``; the first content of a re-stored hash is
kept, as the router's index keeps it), because a stored block's own hash chains from its
parent's. A store it cannot hash exactly as the router would (parent unknown here, bad length or
token ids) goes without ``own_hashes``: the router then hashes that batch's tokens itself. A
payload that is not vLLM's map form with int hashes is passed on unchanged; so are replays.
A rewritten payload is re-encoded from our structs (``dynamo_zmq.llm.BlockStored``), so vLLM's
fields the router does not read (``group_idx``, ``kv_cache_spec_kind``...) are left out.

LoRA: a store of an adapter's blocks chains from ``root_hash(adapter name)``, as the router
hashes a request for that adapter, so base-model and adapter blocks never match each other and
two adapters' blocks are two prefixes. vLLM (0.32) names the adapter (``lora_name``) and also
puts the name first in each block's ``extra_keys``; the name is taken out of them (the root
already carries it), so those blocks are not salted a second time, and the event published in
stores form says the same. An event with only ``lora_id`` gets its name from ``lora_names``
(the engine's adapter table) when it knows the id.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from dynamo_zmq.llm import BlockRemoved, BlockStored, EventBatch
from dynamo_zmq.llm._block_hashing import (
    block_hashes,
    mm_identifiers,
    root_hash,
    salted_block_hashes,
    without_lora_name,
)

__all__ = ["EdgeHasher"]

_MASK64 = (1 << 64) - 1
_decoder = msgspec.msgpack.Decoder(EventBatch)
_encoder = msgspec.msgpack.Encoder()


class EdgeHasher:
    """Adds ``own_hashes`` to the events of one data-parallel rank's payloads, in order."""

    def __init__(self, lora_names: Callable[[int], str | None] | None = None) -> None:
        self._own: dict[int, int] = {}
        self._lora_names = lora_names

    def __len__(self) -> int:
        return len(self._own)

    def rewrite(self, payload: bytes) -> bytes:
        """``payload`` with the own hashes of its stores (unchanged if it is in another form)."""
        batch = self.hash_batch(payload)
        return payload if batch is None else _encoder.encode(batch)

    def hash_batch(self, payload: bytes) -> EventBatch | None:
        """``payload`` decoded, with the own hashes of its stores (None: not vLLM's form)."""
        try:
            batch = _decoder.decode(payload)
        except (msgspec.DecodeError, TypeError, ValueError, RecursionError, MemoryError):
            return None
        own_of = self._own
        for ev in batch.events:
            if type(ev) is BlockStored:
                if ev.lora_id is not None or ev.lora_name is not None:
                    self._name_adapter(ev)
                ev.own_hashes = owns = self._hash(ev)
                if owns is not None:
                    for eh, oh in zip(ev.block_hashes, owns, strict=True):
                        own_of.setdefault(eh & _MASK64, oh)
            elif type(ev) is BlockRemoved:
                for eh in ev.block_hashes:
                    own_of.pop(eh & _MASK64, None)
            else:
                own_of.clear()
        return batch

    def _name_adapter(self, ev: BlockStored) -> None:
        """The adapter's name on ``ev`` (from its id if need be), and out of its extra keys."""
        if ev.lora_name is None and ev.lora_id is not None and self._lora_names is not None:
            ev.lora_name = self._lora_names(ev.lora_id)
        name = ev.lora_name
        if name is not None and ev.extra_keys is not None:
            ev.extra_keys = without_lora_name(ev.extra_keys, name)

    def _hash(self, ev: BlockStored) -> list[int] | None:
        n, size = len(ev.block_hashes), ev.block_size
        if n == 0 or len(ev.token_ids) != n * size:
            return None
        if ev.parent_block_hash is None:
            lora = ev.lora_name if ev.lora_name is not None else ev.lora_id
            seed = root_hash(lora)
        else:
            parent = self._own.get(ev.parent_block_hash & _MASK64)
            if parent is None:
                return None
            seed = parent
        extra = ev.extra_keys = mm_identifiers(ev.extra_keys)
        try:
            if extra is not None and any(k is not None for k in extra):
                if len(extra) != n:
                    return None
                return salted_block_hashes(ev.token_ids, size, seed, extra)
            return block_hashes(ev.token_ids, size, seed)
        except ValueError:
            return None


