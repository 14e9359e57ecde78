"""KV events of LoRA adapter blocks, in vLLM 0.32's shape (issue 35, item 1): a store names the
adapter (``lora_name``, and ``lora_id``) and repeats the name first in each block's
``extra_keys``. At the edge (``engines/vllm/_edge.py``) and in the router's own hashing
(``router/indexer.py``) such blocks chain from ``root_hash(name)`` unsalted by the name, exactly
as the router hashes a request for the adapter: base and adapter blocks of one prompt never
match each other, two adapters are two prefixes, and other extra keys still salt. The real
vLLM engine's events are checked in tests/test_vllm_lora.py."""

from __future__ import annotations

from typing import Any

import msgpack
import msgspec

from dynamo_zmq.llm import EventBatch
from engines.vllm._edge import EdgeHasher
from router.events import decode_batch
from router.hashing import block_hashes, extra_key_hash, root_hash, without_lora_name
from router.indexer import KvIndexer

BS = 4
TOKENS = list(range(10, 10 + 3 * BS))


def _vllm_store(hashes: list[int], tokens: list[int], lora: str | None, lora_id: int | None,
                extra: list[Any] | None, parent: int | None = None) -> bytes:
    """One ``BlockStored`` batch as vLLM 0.32 publishes it (map form, its extra fields)."""
    ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
          "token_ids": tokens, "block_size": BS, "lora_id": lora_id, "medium": "GPU",
          "lora_name": lora, "extra_keys": extra, "group_idx": 0, "session_id": None}
    return msgpack.packb([1.0, [ev], 0])


def _adapter_batch(name: str | None, lora_id: int | None, first: int) -> bytes:
    extra = None if name is None else [[name]] * 3
    return _vllm_store([first, first + 1, first + 2], TOKENS, name, lora_id, extra)


def test_edge_hashes_of_adapter_blocks_are_the_routers_adapter_hashes() -> None:
    hasher = EdgeHasher()
    (base,) = hasher.hash_batch(_adapter_batch(None, None, 100)).events
    (ad,) = hasher.hash_batch(_adapter_batch("ad", 1, 200)).events
    (other,) = hasher.hash_batch(_adapter_batch("other", 2, 300)).events
    assert base.own_hashes == block_hashes(TOKENS, BS)
    assert ad.own_hashes == block_hashes(TOKENS, BS, root_hash("ad"))
    assert other.own_hashes == block_hashes(TOKENS, BS, root_hash("other"))
    assert len({h for ev in (base, ad, other) for h in ev.own_hashes}) == 9  # three prefixes
    # The published store (stores form) says the same: the name, no extra keys left.
    assert ad.lora_name == "ad" and ad.extra_keys is None
    # A child store chains from its adapter parent's own hash.
    (child,) = hasher.hash_batch(_vllm_store([203], list(range(BS)), "ad", 1, [["ad"]],
                                             parent=202)).events
    assert child.own_hashes == block_hashes(TOKENS + list(range(BS)), BS, root_hash("ad"))[-1:]


def test_an_event_with_only_the_adapter_id_is_named_from_the_adapter_table() -> None:
    hasher = EdgeHasher(lora_names={7: "ad"}.get)
    (ev,) = hasher.hash_batch(_vllm_store([1, 2, 3], TOKENS, None, 7, None)).events
    assert ev.lora_name == "ad"
    assert ev.own_hashes == block_hashes(TOKENS, BS, root_hash("ad"))
    (unknown,) = EdgeHasher(lora_names={}.get).hash_batch(
        _vllm_store([1, 2, 3], TOKENS, None, 9, None)).events
    assert unknown.lora_name is None  # an id nobody named chains from the id itself
    assert unknown.own_hashes == block_hashes(TOKENS, BS, root_hash(9))


def test_other_extra_keys_of_an_adapter_block_still_salt_it() -> None:
    hasher = EdgeHasher()
    extra = [["ad", "salt-1"], ["ad"], ["ad"]]  # a cache salt on the first block
    (ev,) = hasher.hash_batch(_vllm_store([1, 2, 3], TOKENS, "ad", 1, extra)).events
    first = extra_key_hash(block_hashes(TOKENS[:BS], BS, root_hash("ad"))[0], ["salt-1"])
    assert ev.own_hashes == [first, *block_hashes(TOKENS[BS:], BS, first)]
    assert ev.extra_keys == [["salt-1"], None, None]
    assert without_lora_name(extra, None) is extra  # the base model's keys are left alone


def test_router_hashing_vllms_own_events_matches_adapter_requests() -> None:
    """Events without own hashes (vLLM's replays, a vLLM not run by our worker) index the
    adapter's blocks where a request for the adapter looks for them."""
    index = KvIndexer(BS)
    index.apply_batch(1, decode_batch(_adapter_batch("ad", 1, 200)))
    index.apply_batch(2, decode_batch(_adapter_batch(None, None, 100)))
    assert index.find_matches(TOKENS, lora="ad") == {(1, 0): 3}
    assert index.find_matches(TOKENS) == {(2, 0): 3}
    assert index.find_matches(TOKENS, lora="other") == {}


def test_edge_rewritten_payload_indexes_like_the_tokens() -> None:
    payload = EdgeHasher().rewrite(_adapter_batch("ad", 1, 200))
    batch = msgspec.msgpack.decode(payload, type=EventBatch)
    index = KvIndexer(BS)
    index.apply_batch(3, batch)
    assert index.find_matches(TOKENS, lora="ad") == {(3, 0): 3}
    assert index.find_matches(TOKENS) == {}
