"""Images on the vLLM engine (issue 36 item 3), through one real vLLM worker serving the tiny
random LLaVA model (``dynamo_zmq.tools.tiny_vlm``, ``--model-impl transformers``) and vLLM's own
offline ``LLM`` in a child process:

- the worker advertises ``vision`` with the model's image token and 16 tokens per image;
- greedy output for a prompt with an image (the run already expanded, as the frontend sends
  it) is vLLM's own offline output for the prompt with one ``<image>`` and that image, and
  another image gives another output;
- the worker's KV events of image blocks carry the router's hashes of (token_ids, media):
  each block salted by the ``mm_hash`` of the images overlapping it;
- a run of the wrong length and data that is not an image are InvalidArgument; images for an
  engine without vision are Unsupported;
- end to end through a frontend and the ``openai`` client, an ``image_url`` data URL: the image
  counts its 16 tokens, the same image gives the same answer, another image another.

Runs only where vLLM is installed; skipped otherwise, except in CI (``CI=true``)."""

from __future__ import annotations

import io
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import tests.support.needs_vllm  # noqa: F401  (skips this module without vLLM; fails it in CI)

# isort: split

import msgspec
import numpy as np
import openai
import pytest_asyncio
import xxhash
import zmq
import zmq.asyncio
from PIL import Image
from tokenizers import Tokenizer

from dynamo_zmq import errors
from dynamo_zmq.llm import BlockStored, Capability, EngineConfig, EventBatch, MediaItem, ModelAdvert
from dynamo_zmq.llm._block_hashing import ROOT_SEED, salted_block_hashes
from dynamo_zmq.tools.tiny_vlm import build_tiny_vlm
from engines.vllm._vision import prompt_inputs
from router.hashing import request_hashes
from tests.conftest import runtime_factory
from tests.support.images import data_url
from tests.support.procs import Proc, run_cli
from tests.support.vllm_kv import kv_ports
from tests.support.vllm_stack import VLLM_ENV, WORKER_FLAGS, WORKER_START, wait_models
from tests.support.waiting import eventually

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

BLOCK = 32
MAX_TOKENS = 12
MAX_MODEL_LEN = 512
PER_IMAGE = 16  # (32 / 8) ** 2
IMAGE_AT = 24  # the run [24, 40) overlaps blocks 0 and 1


def noise_png(seed: int) -> bytes:
    """A 32x32 PNG of seeded RGB noise."""
    pixels = np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def media(data: bytes, offset: int = IMAGE_AT, length: int = PER_IMAGE) -> dict:
    return {"data": data, "mm_hash": xxhash.xxh3_64_hexdigest(data), "offset": offset,
            "length": length}


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cached = os.environ.get("DYN_TINY_VLM_DIR")
    return build_tiny_vlm(Path(cached) if cached else tmp_path_factory.mktemp("vlm") / "model")


@pytest.fixture(scope="module")
def image_token(tiny_vlm: Path) -> int:
    return int(json.loads((tiny_vlm / "config.json").read_text())["image_token_index"])


@pytest.fixture(scope="module")
def text(tiny_vlm: Path) -> tuple[list[int], list[int]]:
    """Token ids before (24) and after (60) the image."""
    tok = Tokenizer.from_file(str(tiny_vlm / "tokenizer.json"))
    words = "the old house near the water was a picture of the world and the light " * 12
    ids = tok.encode(words).ids
    assert len(ids) >= IMAGE_AT + 60
    return ids[:IMAGE_AT], ids[IMAGE_AT:IMAGE_AT + 60]


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return [noise_png(0), noise_png(1)]


@pytest.fixture(scope="module")
def offline(tiny_vlm: Path, text, images, image_token: int,
            tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    """vLLM's own offline greedy ids for the prompt with one ``<image>`` and each image."""
    root = tmp_path_factory.mktemp("images")
    cases = []
    for i, data in enumerate(images):
        (root / f"{i}.png").write_bytes(data)
        cases.append([text[0] + [image_token] + text[1], str(root / f"{i}.png")])
    done = run_cli("-m", "tests.support.vllm_offline_vlm", str(tiny_vlm), str(MAX_MODEL_LEN),
                   str(MAX_TOKENS), json.dumps(cases), timeout=300, env=VLLM_ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def worker(tiny_vlm: Path) -> Iterator[Proc]:
    namespace = f"t{uuid.uuid4().hex[:12]}"
    proc = Proc(["-m", "dynamo_zmq.worker", "--engine", "vllm", "--model-path", str(tiny_vlm),
                 "--model-name", "vlm", "--namespace", namespace, "--host", "127.0.0.1",
                 *WORKER_FLAGS, "--model-impl", "transformers", "--kv-event-form", "stores"],
                env=VLLM_ENV)
    proc.namespace = namespace  # type: ignore[attr-defined]
    try:
        yield proc.wait_ready(WORKER_START)
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def frontend(worker: Proc) -> Iterator[str]:
    proc = Proc(["-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace",
                 worker.namespace])  # type: ignore[attr-defined]
    try:
        yield proc.wait_ready(60).address
    finally:
        proc.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def runtime(worker: Proc):
    async with runtime_factory() as make:
        yield make(static=(worker.address,))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(worker: Proc, runtime):
    client = await runtime.endpoint(f"{worker.namespace}.backend.generate").client()
    await client.wait_for_instances(timeout=15)
    return client


def request(tokens: list[int], items: list[dict] | None = None, max_tokens: int = MAX_TOKENS
            ) -> dict:
    return {"token_ids": list(tokens), "sampling": {"temperature": 0.0},
            "stop": {"max_tokens": max_tokens}, **({"media": items} if items else {})}


async def token_ids(client, req: dict) -> list[int]:
    chunks = [r.data() async for r in await client.generate(req)]
    assert chunks[-1]["finish_reason"] in ("length", "stop"), chunks[-1]
    return [t for c in chunks for t in c.get("token_ids", [])]


def expanded(text: tuple[list[int], list[int]], image_token: int) -> list[int]:
    return text[0] + [image_token] * PER_IMAGE + text[1]


# -- output ------------------------------------------------------------------------------------


async def test_image_output_is_vllms_offline_output_and_depends_on_the_image(
    client, runtime, text, images, image_token, offline
):
    (peer,) = [p for p in await runtime.peers() if p.description]
    (info,) = [e for e in peer.description.endpoints if e.name == "generate"]
    advert = ModelAdvert.from_metadata(info.metadata)
    assert Capability.VISION in advert.capabilities
    assert (advert.engine.image_token_id, advert.engine.tokens_per_image) == (image_token,
                                                                              PER_IMAGE)
    prompt = expanded(text, image_token)
    outs = [await token_ids(client, request(prompt, [media(data)])) for data in images]
    assert outs == offline
    assert outs[0] != outs[1]


async def test_bad_runs_and_bad_images_are_invalid_arguments(client, text, images,
                                                             image_token):
    prompt = expanded(text, image_token)
    with pytest.raises(errors.InvalidArgument, match="not 16 tokens"):
        await token_ids(client, request(prompt, [media(images[0], length=PER_IMAGE - 1)]))
    bad = {**media(images[0]), "data": b"not an image", "mm_hash": "0" * 16}
    with pytest.raises(errors.InvalidArgument, match="not a readable image"):
        await token_ids(client, request(prompt, [bad]))
    assert await token_ids(client, request(prompt, [media(images[0])]))  # the worker goes on


async def test_images_for_an_engine_without_vision_are_unsupported() -> None:
    text_only = EngineConfig(model_name="m", served_model_name="tiny")
    item = MediaItem(data=b"x", mm_hash="0" * 16, offset=0, length=1)
    with pytest.raises(errors.Unsupported, match="'tiny' takes no images"):
        prompt_inputs([5], [item], text_only)


# -- KV events ---------------------------------------------------------------------------------


async def test_kv_events_of_image_blocks_hash_like_the_routers_image_requests(
    client, worker, text, images, image_token
):
    pub, _replay = kv_ports(worker)
    zctx = zmq.asyncio.Context()
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{pub}")
    stores: list[BlockStored] = []

    async def drain() -> None:
        while await sub.poll(300):
            _topic, _seq, payload = await sub.recv_multipart()
            batch = msgspec.msgpack.decode(payload, type=EventBatch)
            stores.extend(ev for ev in batch.events if isinstance(ev, BlockStored))

    try:
        async def joined() -> bool:  # the SUB is joined once a fresh prompt's store reaches it
            fresh = [7, 8] + [uuid.uuid4().int % 400 + 4] * BLOCK
            await token_ids(client, request(fresh, max_tokens=1))
            await drain()
            return bool(stores)

        await eventually(joined, timeout=30)
        stores.clear()
        data = noise_png(7)  # an image no earlier request sent: its blocks are new
        prompt = expanded(text, image_token)  # 100 tokens: 3 full blocks
        await token_ids(client, request(prompt, [media(data)], max_tokens=1))
        await drain()
        h = xxhash.xxh3_64_hexdigest(data)
        keys = [[h], [h], None]  # the run [24, 40) overlaps blocks 0 and 1
        router = request_hashes(prompt, BLOCK, media=[MediaItem(**media(data))])
        assert router == salted_block_hashes(prompt[:3 * BLOCK], BLOCK, ROOT_SEED, keys)
        assert [x for ev in stores for x in ev.own_hashes or []] == router
        # The published extra keys are the router's: vLLM's (uuid, offset) pairs normalised.
        assert [k for ev in stores for k in ev.extra_keys or [None] * len(ev.block_hashes)
                ] == keys
    finally:
        sub.close(0)
        zctx.term()


# -- end to end --------------------------------------------------------------------------------


async def test_an_image_data_url_through_a_frontend_and_the_openai_client(
    frontend: str, images
):
    await wait_models(frontend, names=("vlm",))

    async def ask(client: openai.AsyncOpenAI, *parts: dict) -> tuple[str, int]:
        done = await client.chat.completions.create(
            model="vlm", max_tokens=MAX_TOKENS, temperature=0.0,
            messages=[{"role": "user", "content": list(parts)}])  # type: ignore[misc, list-item]
        assert done.usage is not None
        return done.choices[0].message.content or "", done.usage.prompt_tokens

    text = {"type": "text", "text": "What is in this picture?"}
    async with openai.AsyncOpenAI(base_url=f"{frontend}/v1", api_key="none",
                                  max_retries=0) as client:
        _, plain_tokens = await ask(client, text)
        outs = [await ask(client, text, {"type": "image_url",
                                         "image_url": {"url": data_url(d)}})
                for d in (images[0], images[1], images[0])]
    assert [n for _, n in outs] == [plain_tokens + PER_IMAGE] * 3  # the image's run
    assert outs[0] == outs[2] and outs[0][0] != outs[1][0]
