"""Block hashes of the mocker's prefix cache: xxhash64 chained over full blocks of token ids.
A LoRA adapter's blocks chain from a root of their own (``lora_roots``), in the prefix cache's
hashes and in the router hashes published with them alike: its KV is not the base model's."""

from __future__ import annotations

import array
from collections.abc import Sequence

import xxhash

from dynamo_zmq.llm._block_hashing import ROOT_SEED

__all__ = ["block_hash", "chain_hashes", "lora_roots"]


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return array.array("I", tokens).tobytes()


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The uint64 hash of one full block: xxhash64 of the parent's hash (8 bytes, little-endian;
    absent for the first block) followed by the tokens as uint32."""
    data = _token_bytes(tokens)
    if parent is not None:
        data = parent.to_bytes(8, "little") + data
    return xxhash.xxh64_intdigest(data)


def chain_hashes(tokens: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """Hashes of every full block of ``tokens``, each chained to the one before it."""
    out: list[int] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start : start + block_size])
        out.append(parent)
    return out


def lora_roots(lora_name: str | None, router_seed: int | None) -> tuple[int | None, int | None]:
    """The parents of a sequence's first block: in the prefix cache (None: the base model) and
    in the router's hashes (None: ``ROOT_SEED``; for an adapter ``root_hash(lora_name)``, or
    its equivalent under another ``--kv-hash-seed``)."""
    if lora_name is None:
        return None, router_seed
    salt = b"lora:" + lora_name.encode()
    return (xxhash.xxh64_intdigest(salt),
            xxhash.xxh3_64_intdigest(salt, ROOT_SEED if router_seed is None else router_seed))
