"""The router's own block hashes (the ``dynamo-zmq/xxh3-chain`` scheme, version 1), shared by the
KV router, which computes them from the token ids of engines' KV events, and by our own workers,
which publish them with each stored block ("hashed at the edge", see ``KvHashScheme``).

A block's hash is chained to its parent, so equal hashes mean equal *prefixes*, not just equal
blocks::

    h_0 = xxh3_64(tokens of block 0 as little-endian uint32, seed=ROOT_SEED)
    h_i = xxh3_64(tokens of block i as little-endian uint32, seed=h_{i-1})

Only full blocks are hashed; a trailing partial block is ignored (engines never cache it).
Seeding xxh3 with the parent (rather than hashing the parent's 8 bytes in front of the
tokens) lets each block be hashed from a zero-copy ``memoryview`` slice: no bytes object is built
per block. Measured on this project's 2-core dev machine (scripts/bench_indexer.py): 2,048
blocks of 32 tokens take ~0.2 ms from packed bytes or a numpy array and ~0.45 ms from a Python
list (over half of that is the list -> uint32 conversion).
"""


from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import xxhash

__all__ = [
    "FORM_DELTAS",
    "FORM_STORES",
    "HASH_SCHEME",
    "HASH_SCHEME_VERSION",
    "ROOT_SEED",
    "KvHashScheme",
    "block_hashes",
    "extra_key_hash",
    "mm_identifiers",
    "root_hash",
    "salted_block_hashes",
    "token_bytes",
    "without_lora_name",
]

#: Parent of the first block of every sequence without LoRA (an arbitrary fixed constant).
ROOT_SEED = xxhash.xxh3_64_intdigest(b"dynamo-zmq/router/block-hash/v1")
#: Name and version of the scheme this module implements, as workers declare it.
HASH_SCHEME = "dynamo-zmq/xxh3-chain"
HASH_SCHEME_VERSION = 1
#: ``KvHashScheme.form`` values: vLLM's event shape with own hashes, or own-hash deltas.
FORM_STORES = "stores"
FORM_DELTAS = "deltas"


class KvHashScheme(msgspec.Struct, forbid_unknown_fields=False):
    """How a worker hashes the ``own_hashes`` it publishes with each ``BlockStored`` (advertised
    in its ``EngineConfig.kv_hash_scheme``). A router uses them instead of hashing the event's
    token ids only when it knows the scheme and its block size and seed are the router's.

    ``form`` says what its KV-event payloads are: ``"stores"``, vLLM's events with
    ``own_hashes`` added to each ``BlockStored``; ``"deltas"``, ``OwnBatch`` payloads
    (``OwnStored`` / ``OwnRemoved``, see ``dynamo_zmq.llm._kv_events``)."""

    name: str
    version: int
    block_size: int
    seed: int
    form: str = FORM_STORES

    @classmethod
    def ours(cls, block_size: int, form: str = FORM_STORES) -> KvHashScheme:
        """This module's scheme for ``block_size``-token blocks, published in ``form``."""
        return cls(HASH_SCHEME, HASH_SCHEME_VERSION, block_size, ROOT_SEED, form)

    def usable_by(self, block_size: int) -> bool:
        """Are hashes under this scheme exactly what a router with ``block_size`` computes?"""
        return (self.name == HASH_SCHEME and self.version == HASH_SCHEME_VERSION
                and self.block_size == block_size and self.seed == ROOT_SEED)

_h64 = xxhash.xxh3_64_intdigest
_LITTLE = sys.byteorder == "little"
_U32LE = np.dtype("<u4")
assert array.array("I").itemsize == 4, "router.hashing needs a 32-bit C unsigned int"

TokenIds = Sequence[int] | np.ndarray | bytes | bytearray | memoryview


def token_bytes(token_ids: TokenIds) -> bytes:
    """Token ids as packed little-endian uint32 bytes.

    Args:
        token_ids: a sequence of ints, a numpy integer array, or bytes that already hold packed
            little-endian uint32 ids (passed through unchanged).

    Raises:
        ValueError: a token id is negative or does not fit in 32 bits.
    """
    if type(token_ids) is not list:
        if isinstance(token_ids, (bytes, bytearray, memoryview)):
            data = bytes(token_ids)
            if len(data) % 4:
                raise ValueError(f"packed token ids must be a multiple of 4 bytes, got {len(data)}")
            return data
        if isinstance(token_ids, np.ndarray):
            if token_ids.dtype.kind not in "iu":
                raise ValueError(f"token ids must be integers, got dtype {token_ids.dtype}")
            if token_ids.dtype != _U32LE:
                if token_ids.size and (token_ids.min() < 0 or token_ids.max() > 0xFFFFFFFF):
                    raise ValueError("token ids must be ints in [0, 2**32)")
                token_ids = token_ids.astype(_U32LE)
            return token_ids.tobytes()
    try:
        arr = array.array("I", token_ids)  # C unsigned int: 32 bits (checked at import)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be ints in [0, 2**32): {exc}") from exc
    if not _LITTLE:  # pragma: no cover - big-endian hosts only
        arr.byteswap()
    return arr.tobytes()


def block_hashes(token_ids: TokenIds, block_size: int, parent: int | None = None) -> list[int]:
    """The chained hashes of every full block of ``token_ids``.

    Args:
        token_ids: the tokens (see ``token_bytes`` for the accepted forms).
        block_size: tokens per block (> 0).
        parent: the hash of the block before the first one; ``None`` means the sequence starts
            here (``ROOT_SEED``).

    Returns:
        One uint64 per full block, in order.

    Raises:
        ValueError: bad token ids or block size.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    data = token_bytes(token_ids)
    step = block_size * 4
    h = ROOT_SEED if parent is None else parent
    if len(data) == step:  # one block: the common single-block KV event
        return [_h64(data, h)]
    out: list[int] = []
    append = out.append
    h64, view = _h64, memoryview(data)
    for off in range(0, len(data) - step + 1, step):
        h = h64(view[off : off + step], h)
        append(h)
    return out


def root_hash(lora: int | str | None = None) -> int:
    """The parent of a sequence's first block: ``ROOT_SEED``, or a per-adapter seed for LoRA.

    Blocks computed under a LoRA adapter hold different KV than the base model's for the same
    tokens, so they chain from their own root and never match a base-model prompt.
    """
    if lora is None:
        return ROOT_SEED
    return _h64(b"lora:" + str(lora).encode(), ROOT_SEED)


def extra_key_hash(own_hash: int, extra_key: Any) -> int:
    """Salt one block's hash with the engine's extra key (multimodal hashes, cache salt...).

    Such a block's KV is not determined by its token ids alone, so a token-only prompt must
    never match it; its children chain from the salted hash.
    """
    return _h64(b"extra:" + msgspec.msgpack.encode(extra_key), own_hash)


def salted_block_hashes(
    token_ids: TokenIds, block_size: int, parent: int, extra_keys: Sequence[Any]
) -> list[int]:
    """The chained hashes of ``len(extra_keys)`` full blocks, each salted with its extra key.

    A block whose extra key is ``None`` hashes as in ``block_hashes``; one with an extra key is
    salted (``extra_key_hash``), and its successors chain from the salted hash.

    Args:
        token_ids: the blocks' tokens, concatenated (ints, see ``token_bytes``).
        block_size: tokens per block (> 0).
        parent: the hash of the block before the first one.
        extra_keys: per block, the engine's extra hash inputs or ``None``.

    Raises:
        ValueError: bad token ids or block size.
    """
    owns: list[int] = []
    for i, extra in enumerate(extra_keys):
        (h,) = block_hashes(token_ids[i * block_size : (i + 1) * block_size], block_size, parent)
        parent = h if extra is None else extra_key_hash(h, extra)
        owns.append(parent)
    return owns


def without_lora_name(extra_keys: list[Any] | None, lora_name: str | None) -> list[Any] | None:
    """A LoRA store's per-block extra keys without the adapter's name, which vLLM puts first
    in each block's (the root, ``root_hash(lora_name)``, already carries the adapter, as it does
    for a request to the adapter): None where a block has nothing left, and None when no block
    has anything left. Without a ``lora_name``, ``extra_keys`` unchanged."""
    if extra_keys is None or lora_name is None:
        return extra_keys
    out: list[Any] = []
    for keys in extra_keys:
        if isinstance(keys, (list, tuple)) and keys and keys[0] == lora_name:
            keys = list(keys[1:]) or None
        out.append(keys)
    return out if any(k is not None for k in out) else None


def mm_identifiers(extra_keys: list[Any] | None) -> list[Any] | None:
    """vLLM's per-block extra keys with each image's ``(mm_identifier, offset in the block)``
    pair replaced by the identifier, which is the image's ``mm_hash`` (the engine passes it as
    vLLM's multimodal UUID): the router's extra key for an image block is the list of the
    ``mm_hash`` of the images overlapping it. Other keys (LoRA names, cache salts) stay."""
    if extra_keys is None:
        return None

    def key(k: Any) -> Any:
        if (isinstance(k, (list, tuple)) and len(k) == 2 and isinstance(k[0], str)
                and isinstance(k[1], int)):
            return k[0]
        return k

    return [[key(k) for k in keys] if isinstance(keys, (list, tuple)) else keys
            for keys in extra_keys]
