"""Images in KV block hashes (``dynamo_zmq.llm._media_keys``): the router's request hashes and
the mocker's published hashes of a prompt with images equal a brute-force model of the
scheme (each block salted with the ``mm_hash`` of the images overlapping it); another image
changes the hashes from its first block on and nothing before; and the mocker refuses media
that does not fit the prompt (``InvalidArgument``). Real mocker engine, no mocks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_zmq import errors
from dynamo_zmq.context import Context
from dynamo_zmq.llm import Capability, MediaItem, PreprocessedRequest, StopConditions
from dynamo_zmq.llm._block_hashing import ROOT_SEED
from dynamo_zmq.llm._media_keys import mm_hash
from engines.mocker import MockerConfig, MockerEngine
from engines.mocker._sequence import Sequence
from router.hashing import request_hashes

IMAGE = 7  # the image token of these prompts


def brute_force(tokens: list[int], block_size: int, media: list[MediaItem]) -> list[int]:
    """The scheme, written out: chained xxh3 over each full block's uint32 tokens, a block
    that an image's run overlaps salted with those images' hashes (msgpack list)."""
    out: list[int] = []
    parent = ROOT_SEED
    for b in range(len(tokens) // block_size):
        lo, hi = b * block_size, (b + 1) * block_size
        data = b"".join(t.to_bytes(4, "little") for t in tokens[lo:hi])
        h = xxhash.xxh3_64_intdigest(data, parent)
        keys = [m.mm_hash for m in media if m.offset < hi and m.offset + m.length > lo]
        if keys:
            h = xxhash.xxh3_64_intdigest(b"extra:" + msgspec.msgpack.encode(keys), h)
        out.append(h)
        parent = h
    return out


@st.composite
def prompts(draw: Any) -> tuple[list[int], int, list[MediaItem]]:
    """A prompt with 0-3 images (runs of IMAGE between text), and a block size."""
    block_size = draw(st.integers(1, 8))
    tokens: list[int] = []
    media: list[MediaItem] = []
    for _ in range(draw(st.integers(0, 3))):
        tokens += draw(st.lists(st.integers(8, 500), max_size=12))
        data = draw(st.binary(min_size=1, max_size=16))
        length = draw(st.integers(1, 10))
        media.append(MediaItem(data, mm_hash(data), len(tokens), length))
        tokens += [IMAGE] * length
    tokens += draw(st.lists(st.integers(8, 500), min_size=1, max_size=12))
    return tokens, block_size, media


def mocker_hashes(tokens: list[int], block_size: int, media: list[MediaItem]) -> list[int]:
    seq = Sequence(tokens, block_size=block_size, vocab_size=1000, seed=0, max_tokens=1,
                   media=media)
    return seq.own_hashes(len(tokens) // block_size)


@settings(max_examples=150, deadline=None)
@given(prompts())
def test_router_and_mocker_hashes_equal_the_brute_force_model(case) -> None:
    tokens, block_size, media = case
    expected = brute_force(tokens, block_size, media)
    assert request_hashes(tokens, block_size, None, media) == expected
    assert mocker_hashes(tokens, block_size, media) == expected
    if not media:  # no image: the plain token hashes
        assert request_hashes(tokens, block_size) == expected


@settings(max_examples=150, deadline=None)
@given(prompts(), st.data())
def test_another_image_changes_the_hashes_from_its_first_block_on(case, data) -> None:
    tokens, block_size, media = case
    if not media:
        return
    k = data.draw(st.integers(0, len(media) - 1))
    other = media[k].data + b"!"
    changed = [*media[:k], MediaItem(other, mm_hash(other), media[k].offset, media[k].length),
               *media[k + 1:]]
    same = [MediaItem(bytes(m.data), mm_hash(bytes(m.data)), m.offset, m.length) for m in media]
    before = request_hashes(tokens, block_size, None, media)
    assert request_hashes(tokens, block_size, None, same) == before  # identical image: same
    after = request_hashes(tokens, block_size, None, changed)
    first = media[k].offset // block_size  # the first block the image's run overlaps
    assert after[:first] == before[:first]
    assert all(a != b for a, b in zip(after[first:], before[first:], strict=True))
    assert mocker_hashes(tokens, block_size, changed) == after


@pytest.fixture
async def vision_mocker() -> AsyncIterator[MockerEngine]:
    engine = MockerEngine(MockerConfig(speedup_ratio=1e6, enable_kv_events=False, block_size=4,
                                       num_gpu_blocks=64, host="127.0.0.1", vocab_size=100,
                                       tokens_per_image=3, image_token_id=IMAGE))
    await engine.start(worker_id=1)
    yield engine
    await engine.cleanup()


def image_request(tokens: list[int], media: list[MediaItem]) -> PreprocessedRequest:
    return PreprocessedRequest(tokens, stop=StopConditions(max_tokens=2), media=media)


async def run(engine: MockerEngine, req: PreprocessedRequest) -> Any:
    return [c async for c in engine.generate(req, Context())]


async def test_the_mocker_takes_consistent_images_and_counts_their_tokens(
    vision_mocker: MockerEngine,
) -> None:
    assert Capability.VISION in vision_mocker.capabilities()
    config = vision_mocker.engine_config
    assert config is not None
    assert (config.image_token_id, config.tokens_per_image) == (IMAGE, 3)
    png = b"\x89PNG\r\n\x1a\nimage"
    tokens = [10, 11, IMAGE, IMAGE, IMAGE, 12]
    chunks = await run(vision_mocker, image_request(tokens, [MediaItem(png, mm_hash(png), 2, 3)]))
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens == 6


@pytest.mark.parametrize(("tokens", "item", "problem"), [
    ([10, IMAGE, IMAGE, IMAGE], {"offset": 0}, "holds tokens other than the image token"),
    ([10, IMAGE, IMAGE, IMAGE], {"offset": 2}, "is not inside the 4-token prompt"),
    ([10, IMAGE, IMAGE, IMAGE], {"length": 2}, "takes 2 tokens; this mocker's images take 3"),
    ([10, IMAGE, IMAGE, IMAGE], {"mm_hash": "0" * 16}, "mm_hash is not the xxh3-64"),
])
async def test_the_mocker_refuses_media_that_does_not_fit_the_prompt(
    vision_mocker: MockerEngine, tokens: list[int], item: dict[str, Any], problem: str,
) -> None:
    data = b"\x89PNG\r\n\x1a\nimage"
    fields = {"data": data, "mm_hash": mm_hash(data), "offset": 1, "length": 3, **item}
    with pytest.raises(errors.InvalidArgument, match=problem):
        await run(vision_mocker, image_request(tokens, [MediaItem(**fields)]))


async def test_a_mocker_without_tokens_per_image_refuses_images() -> None:
    engine = MockerEngine(MockerConfig(speedup_ratio=1e6, enable_kv_events=False,
                                       host="127.0.0.1", vocab_size=100))
    await engine.start(worker_id=1)
    try:
        assert Capability.VISION not in engine.capabilities()
        data = b"\x89PNG\r\n\x1a\n"
        with pytest.raises(errors.InvalidArgument, match="--tokens-per-image"):
            await run(engine, image_request([IMAGE] * 3, [MediaItem(data, mm_hash(data), 0, 3)]))
    finally:
        await engine.cleanup()
