"""Block hashes of the mocker's prefix cache: xxhash64 chained over full blocks of token ids."""

from __future__ import annotations

import array
from collections.abc import Sequence

import xxhash

__all__ = ["block_hash", "chain_hashes"]


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
