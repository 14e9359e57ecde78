"""The router's own block hashes, recomputed from token ids unless a worker publishes them.

Every engine hashes blocks its own way (vLLM: sha256 or Python ``hash``, optionally salted; SGLang
and the mocker: others), so the router keys its index by a hash of its own: the chained xxh3
scheme of ``dynamo_zmq.llm._block_hashing`` (its docstring has the definition), computed from the
token ids each KV event carries, or taken from the event's ``own_hashes`` when the worker
declares that very scheme (``KvHashScheme``: our mocker and vLLM adapters hash at the edge).
"""

from collections.abc import Sequence
from typing import Any

from dynamo_zmq.llm._block_hashing import HASH_SCHEME as HASH_SCHEME
from dynamo_zmq.llm._block_hashing import HASH_SCHEME_VERSION as HASH_SCHEME_VERSION
from dynamo_zmq.llm._block_hashing import ROOT_SEED as ROOT_SEED
from dynamo_zmq.llm._block_hashing import KvHashScheme as KvHashScheme
from dynamo_zmq.llm._block_hashing import TokenIds as TokenIds
from dynamo_zmq.llm._block_hashing import block_hashes as block_hashes
from dynamo_zmq.llm._block_hashing import extra_key_hash as extra_key_hash
from dynamo_zmq.llm._block_hashing import mm_identifiers as mm_identifiers
from dynamo_zmq.llm._block_hashing import root_hash as root_hash
from dynamo_zmq.llm._block_hashing import salted_block_hashes as salted_block_hashes
from dynamo_zmq.llm._block_hashing import token_bytes as token_bytes
from dynamo_zmq.llm._block_hashing import without_lora_name as without_lora_name
from dynamo_zmq.llm._media_keys import block_extra_keys as block_extra_keys
from dynamo_zmq.llm._media_keys import media_block_hashes as media_block_hashes
from dynamo_zmq.llm._messages import MediaItem

__all__ = [
    "HASH_SCHEME",
    "HASH_SCHEME_VERSION",
    "ROOT_SEED",
    "KvHashScheme",
    "TokenIds",
    "block_extra_keys",
    "block_hashes",
    "event_own_hashes",
    "extra_key_hash",
    "media_block_hashes",
    "mm_identifiers",
    "request_hashes",
    "root_hash",
    "salted_block_hashes",
    "token_bytes",
    "without_lora_name",
]


def request_hashes(token_ids: TokenIds, block_size: int, lora_name: str | None = None,
                   media: Sequence[MediaItem] | None = None) -> list[int]:
    """A request's block hashes as the KV router matches them: chained from ``ROOT_SEED``, or,
    for a request with a LoRA adapter, from the adapter's own root (``root_hash``), so the base
    model's blocks never match it, nor another adapter's; each block an image of ``media``
    overlaps salted with the images' ``mm_hash`` (``media_block_hashes``)."""
    root = None if lora_name is None else root_hash(lora_name)
    return media_block_hashes(token_ids, block_size, root, media)


def event_own_hashes(token_ids: Sequence[int], block_size: int, seed: int, n: int,
                     own_hashes: list[int] | None,
                     extra_keys: list[Any] | None) -> list[int] | None:
    """The router's hashes of a stored event's ``n`` blocks chained from ``seed``: the worker's
    ``own_hashes`` (hashed at the edge), else computed from ``token_ids``, salted per block by
    ``extra_keys`` when any is set. None when ``extra_keys`` is not one per block.

    Raises:
        ValueError: a token id outside [0, 2**32).
    """
    if own_hashes is not None:
        return own_hashes
    if extra_keys is not None and any(k is not None for k in extra_keys):
        if len(extra_keys) != n:
            return None
        return salted_block_hashes(token_ids, block_size, seed, extra_keys)
    return block_hashes(token_ids, block_size, seed)
