"""router.events: every accepted KV-event form decodes to the same typed batch; garbage raises
EventDecodeError and nothing else."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import msgpack
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from router.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    decode_batch,
    encode_batch,
    normalize_hash,
)
from tests.support.fixtures import VLLM_KV_EVENTS, vllm_kv_events

FIXTURES = VLLM_KV_EVENTS
MASK = (1 << 64) - 1


def _fixture_files() -> list[Path]:
    vllm_kv_events()  # fails clearly when the captures are missing
    return sorted(FIXTURES.glob("batch_seq*.msgpack"))


# --- real vLLM 0.32 captures -------------------------------------------------------------------


def test_every_fixture_decodes_like_the_reference_codec() -> None:
    files = _fixture_files()
    index = json.loads((FIXTURES / "index.json").read_text())
    assert len(files) == len(index) == 20
    for path, entry in zip(files, index, strict=True):
        payload = path.read_bytes()
        ref = msgpack.unpackb(payload)
        batch = decode_batch(payload)
        assert isinstance(batch, EventBatch)
        assert batch.ts == ref[0]
        assert batch.dp_rank == ref[2] == 0
        assert [type(e).__name__ for e in batch.events] == entry["events"]
        for ev, raw in zip(batch.events, ref[1], strict=True):
            assert type(ev).__name__ == raw["type"]
            if isinstance(ev, BlockStored):
                assert ev.block_hashes == raw["block_hashes"]
                assert ev.parent_block_hash == raw["parent_block_hash"]
                assert ev.token_ids == raw["token_ids"]
                assert ev.block_size == raw["block_size"] == 32
                assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
                assert ev.medium == "GPU" and ev.lora_id is None
                assert ev.extra_keys == [None] * len(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                assert ev.block_hashes == raw["block_hashes"]


def test_fixture_round_trips_through_encode_batch() -> None:
    for path in _fixture_files():
        batch = decode_batch(path.read_bytes())
        again = decode_batch(encode_batch(batch.events, batch.dp_rank, batch.ts))
        assert again == batch


# --- map form (current vLLM) ---------------------------------------------------------------------


def _stored_map(
    hashes: list[Any], parent: Any, tokens: list[int], bs: int, **extra: Any
) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": bs, "lora_id": None, "medium": "GPU", **extra}


def test_map_form_ignores_unknown_keys_and_keeps_lora_fields() -> None:
    ev = _stored_map([1, 2], None, [1, 2, 3, 4], 2, lora_name="ad", group_idx=3,
                     kv_cache_spec_kind="sliding_window", something_new={"a": [1]})
    ev["lora_id"] = 7
    payload = msgpack.packb([1.5, [ev, {"type": "BlockRemoved", "block_hashes": [2], "x": 1},
                                   {"type": "AllBlocksCleared", "y": None}], 3])
    batch = decode_batch(payload)
    assert batch == EventBatch(1.5, [BlockStored([1, 2], None, [1, 2, 3, 4], 2, 7, "GPU", "ad"),
                                     BlockRemoved([2]), AllBlocksCleared()], 3)


def test_map_form_dp_rank_nil_or_missing() -> None:
    ev = {"type": "AllBlocksCleared"}
    assert decode_batch(msgpack.packb([1.0, [ev], None])).dp_rank is None
    assert decode_batch(msgpack.packb([1.0, [ev]])).dp_rank is None
    assert decode_batch(msgpack.packb([2, []])).ts == 2.0  # an int timestamp is accepted


def test_uint64_extremes_are_kept() -> None:
    payload = msgpack.packb([0.0, [_stored_map([MASK, 0], 1 << 63, [0] * 4, 2)], 0])
    ev = decode_batch(payload).events[0]
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == [MASK, 0] and ev.parent_block_hash == 1 << 63


# --- tagged arrays (older vLLM, SGLang) ----------------------------------------------------------


def test_tagged_array_form() -> None:
    payload = msgpack.packb([2.5, [
        ["BlockStored", [11, 12], None, [5, 6, 7, 8], 2, None, "GPU"],
        ["BlockStored", [13], 12, [9, 10], 2],  # trailing lora_id/medium omitted
        ["BlockStored", [14], 13, [1, 1], 2, 4, "CPU", "lora-a", "future-field"],  # extra
        ["BlockRemoved", [11], "GPU"],
        ["BlockRemoved", [12]],
        ["AllBlocksCleared"],
    ], 1])
    batch = decode_batch(payload)
    assert batch.ts == 2.5 and batch.dp_rank == 1
    assert batch.events == [
        BlockStored([11, 12], None, [5, 6, 7, 8], 2, None, "GPU"),
        BlockStored([13], 12, [9, 10], 2),
        BlockStored([14], 13, [1, 1], 2, 4, "CPU", "lora-a"),
        BlockRemoved([11], "GPU"),
        BlockRemoved([12]),
        AllBlocksCleared(),
    ]
    # Consumers may dispatch on the exact class: the fallback forms are converted.
    assert [type(e) for e in batch.events][:1] == [BlockStored]


def test_sglang_signed_hashes_and_missing_rank() -> None:
    neg, parent = -(1 << 63), -5
    payload = msgpack.packb([3.0, [
        ["BlockStored", [neg, -1, 7], parent, list(range(6)), 2, None],
        ["BlockRemoved", [-1]],
    ]])  # SGLang without attention DP: no rank
    batch = decode_batch(payload)
    assert batch.dp_rank is None
    stored, removed = batch.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert stored.block_hashes == [neg & MASK, MASK, 7]
    assert stored.parent_block_hash == parent & MASK
    assert removed.block_hashes == [MASK]
    # An explicit nil rank, too.
    assert decode_batch(msgpack.packb([3.0, [["AllBlocksCleared"]], None])).dp_rank is None


def test_signed_hashes_in_map_form_are_masked() -> None:
    payload = msgpack.packb([0.0, [_stored_map([-2], -3, [1, 2], 2),
                                   {"type": "BlockRemoved", "block_hashes": [-2]}], 0])
    stored, removed = decode_batch(payload).events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert stored.block_hashes == [MASK - 1] and stored.parent_block_hash == MASK - 2
    assert removed.block_hashes == [MASK - 1]


# --- bytes hashes (vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) ------------------------------


def test_bytes_hashes_map_form() -> None:
    d1 = hashlib.sha256(b"block-1").digest()
    d2 = hashlib.sha256(b"block-2").digest()
    # Same last 8 bytes, different digests: must stay distinct.
    d3 = b"\x01" * 24 + d2[-8:]
    payload = msgpack.packb([0.0, [_stored_map([d2, d3], d1, [1, 2, 3, 4], 2),
                                   {"type": "BlockRemoved", "block_hashes": [d2]}], 0])
    stored, removed = decode_batch(payload).events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert stored.block_hashes == [xxhash.xxh3_64_intdigest(d2), xxhash.xxh3_64_intdigest(d3)]
    assert stored.block_hashes[0] != stored.block_hashes[1]
    assert stored.parent_block_hash == xxhash.xxh3_64_intdigest(d1)
    assert removed.block_hashes == [stored.block_hashes[0]]


def test_bytes_hashes_array_form_and_mixed() -> None:
    d = hashlib.sha256(b"x").digest()
    payload = msgpack.packb([0.0, [["BlockStored", [d, 5], None, [1, 2, 3, 4], 2],
                                   ["BlockRemoved", [d]]], 0])
    stored, removed = decode_batch(payload).events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert stored.block_hashes == [xxhash.xxh3_64_intdigest(d), 5]
    assert removed.block_hashes == [xxhash.xxh3_64_intdigest(d)]


def test_normalize_hash() -> None:
    assert normalize_hash(5) == 5
    assert normalize_hash(-1) == MASK
    assert normalize_hash(b"\x00" * 32) == xxhash.xxh3_64_intdigest(b"\x00" * 32)
    with pytest.raises(EventDecodeError):
        normalize_hash("nope")  # type: ignore[arg-type]


# --- malformed payloads ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        b"\x93\xcb",  # truncated
        msgpack.packb({"ts": 1.0, "events": []}),
        msgpack.packb([1.0]),
        msgpack.packb(["ts", [], 0]),
        msgpack.packb([1.0, {"type": "AllBlocksCleared"}, 0]),
        msgpack.packb([1.0, [{"type": "BlocksMoved"}], 0]),  # unknown event type
        msgpack.packb([1.0, [["BlocksMoved", [1]]], 0]),
        msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1]}], 0]),  # fields missing
        msgpack.packb([1.0, [{"block_hashes": [1]}], 0]),  # untagged
        msgpack.packb([1.0, [_stored_map([1], None, [1, 2], 0)], 0]),  # block_size 0
        msgpack.packb([1.0, [_stored_map([1.5], None, [1, 2], 2)], 0]),  # float hash
        msgpack.packb([1.0, [_stored_map([1], None, ["a", 2], 2)], 0]),  # str token
        msgpack.packb([1.0, [_stored_map(["h"], None, [1, 2], 2)], 0]),  # str hash
        msgpack.packb([1.0, [["BlockStored", [1], None]], 0]),  # array form too short
        msgpack.packb([1.0, [], "rank"]),
        msgpack.packb([1.0, [], 0]) + b"\x00",  # trailing bytes
    ],
)
def test_malformed_payload_raises_event_decode_error(payload: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_batch(payload)


@pytest.mark.parametrize("payload", [None, "text", 5, [1.0, [], 0]])
def test_non_bytes_payload_raises_event_decode_error(payload: Any) -> None:
    with pytest.raises(EventDecodeError):
        decode_batch(payload)


def test_event_decode_error_is_a_value_error_with_repr() -> None:
    with pytest.raises(ValueError) as info:
        decode_batch(b"")
    assert repr(info.value).startswith("EventDecodeError(")


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_never_raise_anything_else(data: bytes) -> None:
    try:
        decode_batch(data)
    except EventDecodeError:
        pass


_leaf = (st.none() | st.booleans() | st.integers(min_value=-(1 << 63), max_value=MASK)
         | st.floats(allow_nan=False) | st.binary(max_size=40) | st.text(max_size=12)
         | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"]))
_values = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=6)
                       | st.dictionaries(st.sampled_from(["type", "block_hashes",
                                                          "parent_block_hash", "token_ids",
                                                          "block_size", "medium"])
                                         | st.text(max_size=4),
                                         inner, max_size=6), max_leaves=30)


@settings(max_examples=400, deadline=None)
@given(st.tuples(st.floats(allow_nan=False) | st.integers(-5, 5), st.lists(_values, max_size=4),
                 st.none() | st.integers(-3, 3)))
def test_random_msgpack_shapes_decode_or_raise_event_decode_error(shape: tuple[Any, ...]) -> None:
    payload = msgpack.packb(list(shape))
    try:
        batch = decode_batch(payload)
    except EventDecodeError:
        return
    for ev in batch.events:  # whatever decodes is well-typed and normalized
        if isinstance(ev, (BlockStored, BlockRemoved)):
            assert all(type(h) is int and 0 <= h <= MASK for h in ev.block_hashes)
        if isinstance(ev, BlockStored):
            assert ev.parent_block_hash is None or 0 <= ev.parent_block_hash <= MASK
