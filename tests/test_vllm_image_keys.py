"""vLLM's image extra keys in KV events, without vLLM: each image overlapping a block is a
``(mm_identifier, offset in the block)`` pair there (vLLM 0.32, given ``multi_modal_uuids``);
the edge hasher (``engines/vllm/_edge.py``) and the router's indexer, hashing vLLM's raw events,
both salt the block with the list of identifiers, as the router hashes a request's blocks from
(token_ids, media): same image, same hashes; another image or none, other hashes. Also which
configs advertise images (``image_placeholders``)."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec

from dynamo_zmq.llm import BlockStored, EventBatch
from dynamo_zmq.llm._block_hashing import ROOT_SEED, mm_identifiers, salted_block_hashes
from engines.vllm._edge import EdgeHasher
from engines.vllm._vision import image_placeholders
from router.indexer import KvIndexer

BLOCK = 4
TOKENS = [5, 6, 9, 9, 9, 9, 9, 7, 8, 1, 2, 3]  # the image run [2, 7) overlaps blocks 0 and 1


def vllm_store(mm: str, extra: list | None = None) -> BlockStored:
    """vLLM's store of the three blocks of TOKENS with one image ``mm`` at offset 2."""
    keys = extra if extra is not None else [[[mm, 2]], [[mm, -2]], None]
    return BlockStored([101, 102, 103], None, list(TOKENS), BLOCK, extra_keys=keys)


def routers(mm: str) -> list[int]:
    return salted_block_hashes(TOKENS, BLOCK, ROOT_SEED, [[mm], [mm], None])


def test_mm_pairs_become_identifiers_and_other_keys_stay() -> None:
    assert mm_identifiers(None) is None
    assert mm_identifiers([[["a" * 16, 3], ["b" * 16, -1]], None, ["salt"]]) == [
        ["a" * 16, "b" * 16], None, ["salt"]]


def test_edge_hasher_salts_image_blocks_as_the_router_hashes_the_request() -> None:
    payload = msgspec.msgpack.encode(EventBatch(0.0, [vllm_store("ab" * 8)], None))
    batch = EdgeHasher().hash_batch(payload)
    assert batch is not None
    (ev,) = batch.events
    assert isinstance(ev, BlockStored)
    assert ev.own_hashes == routers("ab" * 8)
    assert ev.extra_keys == [["ab" * 8], ["ab" * 8], None]
    assert ev.own_hashes != routers("cd" * 8)
    assert ev.own_hashes[:2] != salted_block_hashes(TOKENS, BLOCK, ROOT_SEED, [None] * 3)[:2]


def test_router_indexes_vllms_raw_image_events_like_edge_hashed_ones() -> None:
    raw = KvIndexer(BLOCK)
    raw.apply_batch(1, EventBatch(0.0, [vllm_store("ab" * 8)], None))
    assert raw.find_matches_for_hashes(routers("ab" * 8)) == {(1, 0): 3}
    assert raw.find_matches_for_hashes(routers("cd" * 8)) == {}


def test_llava_configs_advertise_their_image_token_and_run_length() -> None:
    def model(kind: str = "llava", multimodal: bool = True, strategy: str = "default",
              size: int = 32) -> SimpleNamespace:
        vision = SimpleNamespace(image_size=size, patch_size=8)
        hf = SimpleNamespace(model_type=kind, image_token_index=512, vision_config=vision,
                             vision_feature_select_strategy=strategy)
        return SimpleNamespace(is_multimodal_model=multimodal, hf_config=hf, model="m")

    assert image_placeholders(model()) == (512, 16)
    assert image_placeholders(model(size=64)) == (512, 64)
    assert image_placeholders(model(strategy="full")) == (512, 17)  # the class token stays
    assert image_placeholders(model(multimodal=False)) is None
    assert image_placeholders(model(kind="llava_next")) is None  # variable tiles: text only
