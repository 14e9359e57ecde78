"""Images through real processes: ``image_url`` content parts sent with the ``openai`` client to
a frontend over mocker workers that take images (``--tokens-per-image``) and one that does not.

Shown: an image costs ``tokens_per_image`` prompt tokens, at its place in the prompt, also in
the context-length check; data URLs that are malformed, not base64, not an image type, not an
image, or too large are refused with 400 naming the part; a remote URL is refused unless its
host is in ``--allowed-media-domains``, and an allowed one is fetched (a local HTTP server), a
non-image or missing one refused; a model whose engine lacks vision refuses images naming the
engine; the Responses API's
``input_image`` parts and the Messages API's ``image`` blocks (``anthropic`` client) count as
chat's; and the KV router matches images by content: the same image and prompt land on the
worker that cached them, with its blocks' credit, while another image after the same text
gets credit only for the blocks before it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest
from tokenizers import Tokenizer

from tests.support.http_calls import get
from tests.support.images import data_url, png, serve_files
from tests.support.metrics import index_blocks
from tests.support.procs import Proc
from tests.support.waiting import eventually

BLOCK = 16
PER_IMAGE = 40
MAX_IMAGE = 100_000
RED, BLUE = png((255, 0, 0)), png((0, 0, 255))


@pytest.fixture(scope="module")
def files() -> Iterator[str]:
    """A local HTTP server with a PNG and a text file: its URL."""
    with serve_files({"/red.png": ("image/png", RED),
                      "/notes.txt": ("text/plain", b"not an image")}) as url:
        yield url


@pytest.fixture(scope="module")
def stack(tiny_model: Path) -> Iterator[str]:
    """Two mockers serving 'vis' with images (``PER_IMAGE`` tokens each, ``BLOCK``-token
    blocks), one serving 'tiny' without, and a KV-routing frontend that fetches images from
    127.0.0.1 only: its URL."""
    namespace = f"t{uuid.uuid4().hex[:12]}"
    base = ["-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path", str(tiny_model),
            "--namespace", namespace, "--host", "127.0.0.1", "--speedup-ratio", "1000",
            "--block-size", str(BLOCK)]
    vision = [*base, "--model-name", "vis", "--tokens-per-image", str(PER_IMAGE)]
    procs = [Proc(vision), Proc(vision), Proc([*base, "--model-name", "tiny"])]
    try:
        front = Proc(["-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace", namespace,
                      "--router-mode", "kv", "--allowed-media-domains", "127.0.0.1",
                      "--max-image-bytes", str(MAX_IMAGE)])
        procs.append(front)
        for proc in procs:
            proc.wait_ready(60)
        deadline = time.monotonic() + 60
        while True:
            status, body = get(f"{front.address}/health")
            models = json.loads(body).get("models", {}) if status == 200 else {}
            if len(models.get("vis", [])) == 2 and len(models.get("tiny", [])) == 1:
                break
            assert time.monotonic() < deadline, f"models not served: {body!r}"
            time.sleep(0.1)
        yield str(front.address)
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture
async def client(stack: str):
    async with openai.AsyncOpenAI(base_url=f"{stack}/v1", api_key="none", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts: str | dict) -> list[dict]:
    """One user message of text and image parts."""
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return [{"role": "user", "content": content}]


def tokens(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


async def prompt_tokens(client, messages: list[dict], model: str = "vis") -> int:
    resp = await client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    return resp.usage.prompt_tokens


async def test_an_image_counts_tokens_per_image_at_its_place_in_the_prompt(
    client, tokenizer, tiny_model: Path
) -> None:
    # The tiny template renders content as text: each image goes where its part is, and
    # the text around it is tokenized as rendered.
    before, after = "<s><|user|>\nWhat is in", "\nthis picture?</s>\n<|assistant|>\n"
    expected = tokens(tokenizer, before + "\n") + PER_IMAGE + tokens(tokenizer, after)
    one = await prompt_tokens(client, user("What is in", image_part(data_url(RED)),
                                           "this picture?"))
    assert one == expected
    two = await prompt_tokens(client, user("What is in", image_part(data_url(RED)),
                                           image_part(data_url(BLUE)), "this picture?"))
    assert two == expected + PER_IMAGE + tokens(tokenizer, "\n")
    context = json.loads((tiny_model / "config.json").read_text())["max_position_embeddings"]
    room = context - one  # the context left: an image's tokens count in the length checks
    await client.chat.completions.create(model="vis", max_tokens=room, messages=user(
        "What is in", image_part(data_url(RED)), "this picture?"))
    with pytest.raises(openai.APIStatusError) as caught:
        await client.chat.completions.create(model="vis", max_tokens=room + 1, messages=user(
            "What is in", image_part(data_url(RED)), "this picture?"))
    assert caught.value.status_code == 413
    resp = await client.chat.completions.create(
        model="vis", messages=user(image_part(data_url(BLUE))), max_tokens=3, stream=True,
        stream_options={"include_usage": True})
    usage = [chunk.usage async for chunk in resp if chunk.usage is not None]
    assert usage[-1].prompt_tokens > PER_IMAGE and usage[-1].completion_tokens == 3


async def test_the_responses_and_messages_apis_take_images_as_chat_does(stack: str,
                                                                       client) -> None:
    chat = await prompt_tokens(client, user("Hi", image_part(data_url(RED))))
    resp = await client.responses.create(model="vis", max_output_tokens=2, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                     {"type": "input_image", "image_url": data_url(RED)}]}])
    assert resp.usage.input_tokens == chat
    encoded = data_url(RED).split(",", 1)[1]
    blocks = [{"type": "text", "text": "Hi"}, {"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": encoded}}]
    async with anthropic.AsyncAnthropic(base_url=stack, api_key="none", max_retries=0) as a:
        message = await a.messages.create(model="vis", max_tokens=2,
                                          messages=[{"role": "user", "content": blocks}])
        assert message.usage.input_tokens == chat
        count = await a.messages.count_tokens(model="vis",
                                              messages=[{"role": "user", "content": blocks}])
        assert count.input_tokens == chat
        blocks[1]["source"]["media_type"] = "text/plain"
        with pytest.raises(anthropic.BadRequestError) as caught:
            await a.messages.create(model="vis", max_tokens=2,
                                    messages=[{"role": "user", "content": blocks}])
        assert "'text/plain' is not an image type" in caught.value.message


def refusal(exc: openai.BadRequestError) -> dict:
    return exc.response.json()["error"]


@pytest.mark.parametrize(("url", "says"), [
    ("data:image/png;base64,***notbase64***", "base64 is invalid"),
    (data_url(RED, "text/plain"), "'text/plain' is not an image type"),
    (data_url(b"just some text"), "does not hold a PNG, JPEG, WebP or GIF image"),
    ("data:image/png," + "x" * 10, "must be base64-encoded"),
    (data_url(RED[:8] + bytes(MAX_IMAGE)), f"larger than {MAX_IMAGE} bytes"),
    ("ftp://127.0.0.1/red.png", "must be a data: URL or an http(s) URL"),
])
async def test_a_bad_data_url_is_refused_naming_the_part(client, url: str, says: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await prompt_tokens(client, user("Look:", image_part(url)))
    error = refusal(caught.value)
    assert says in error["message"]
    assert error["param"] == "messages[0].content[1].image_url.url"


async def test_remote_urls_are_fetched_only_from_allowed_domains(client, files: str) -> None:
    port = files.rsplit(":", 1)[1]
    with pytest.raises(openai.BadRequestError) as caught:  # same server, another host name
        await prompt_tokens(client, user(image_part(f"http://localhost:{port}/red.png")))
    error = refusal(caught.value)
    assert "--allowed-media-domains" in error["message"] and "'localhost'" in error["message"]
    assert error["param"] == "messages[0].content[0].image_url.url"

    fetched = await prompt_tokens(client, user("Hi", image_part(f"{files}/red.png")))
    assert fetched == await prompt_tokens(client, user("Hi", image_part(data_url(RED))))

    for path, says in (("/notes.txt", "not an image"), ("/missing.png", "HTTP 404")):
        with pytest.raises(openai.BadRequestError) as caught:
            await prompt_tokens(client, user(image_part(f"{files}{path}")))
        assert says in refusal(caught.value)["message"]


async def test_an_engine_without_vision_refuses_images_naming_it(client) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await prompt_tokens(client, user("Look:", image_part(data_url(RED))), model="tiny")
    error = refusal(caught.value)
    assert "vision" in error["message"] and "mocker engine" in error["message"]
    assert error["param"] == "messages[0].content[1]"
    assert await prompt_tokens(client, user("Just text"), model="tiny") > 0


async def test_kv_routing_matches_images_by_content(stack: str, client, tokenizer) -> None:
    text = f"Session {uuid.uuid4().hex}: " + "describe every detail of the picture " * 6

    async def send(image: bytes) -> tuple[str, int, int]:
        raw = await client.chat.completions.with_raw_response.create(
            model="vis", messages=user(text, image_part(data_url(image)), "Thanks."),
            max_tokens=2)
        usage = raw.parse().usage
        details = usage.prompt_tokens_details
        cached = (details.cached_tokens if details else 0) or 0
        return raw.headers["x-dynamo-worker"].split("/")[0], usage.prompt_tokens, cached

    first, n, cached = await send(RED)
    assert cached == 0
    full = (n - 1) // BLOCK  # the blocks the mocker caches and matches

    async def indexed() -> bool:
        return (await index_blocks(stack, "vis")).get(first, 0) >= full

    await eventually(indexed, 15, "the image prompt's blocks in the router's index")
    again, _, cached = await send(RED)
    assert again == first and cached == full * BLOCK  # the same image: every block's credit

    offset = tokens(tokenizer, f"<s><|user|>\n{text}\n")  # where the image's run starts
    assert offset >= 2 * BLOCK
    other, _, cached = await send(BLUE)  # the same text first: the same worker...
    assert other == first
    assert cached == offset // BLOCK * BLOCK  # ...but no credit from the image's block on
