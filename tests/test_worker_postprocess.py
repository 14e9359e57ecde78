"""Post-processing in a real worker: the echo engine streams back the prompt's tokens, so a
known text goes through detokenization and stop strings exactly as a model's output would."""

from __future__ import annotations

import asyncio
import shutil
import urllib.request

import pytest
from tokenizers import Tokenizer

from tests.support.metrics import sample
from tests.support.procs import system_port

#: Multi-byte characters split across byte-level tokens, and a stop string of several tokens.
TEXT = "Hello world, the engine streams é 日本 🙂 tokens. STOP here and more after"
STOP = "STOP here"


@pytest.fixture(scope="module")
def ids(tiny_model) -> list[int]:
    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == TEXT
    return ids


async def serve(namespace, spawn, make_runtime, model, *extra: str):
    proc = spawn(
        "-m", "dynamo_zmq.worker", "--model-path", str(model), "--namespace", namespace,
        "--host", "127.0.0.1", "--grace-period", "0",
        "--engine", "tests.support.engines:EchoEngine",
        *extra,
    )
    client = await (
        make_runtime(static=(proc.address,)).endpoint(f"{namespace}.backend.generate").client()
    )
    await client.wait_for_instances(timeout=15)
    return proc, client


async def generate(client, ids, max_tokens, **stop) -> list[dict]:
    req = {"token_ids": ids, "stop": {"max_tokens": max_tokens, **stop}}
    return [r.data() async for r in await client.generate(req)]


def tokens_of(chunks) -> list[int]:
    return [t for c in chunks for t in c.get("token_ids", [])]


def text_of(chunks) -> str:
    return "".join(c.get("text", "") for c in chunks)


def completing_token(tiny_model, ids, needle: str) -> int:
    """How many tokens the stream needs before ``needle`` is complete."""
    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    return next(k for k in range(1, len(ids) + 1) if needle in tokenizer.decode(ids[:k]))


async def test_text_deltas_concatenate_to_the_decoded_text(
    namespace, spawn, make_runtime, tiny_model, ids
):
    _, client = await serve(namespace, spawn, make_runtime, tiny_model)
    chunks = await generate(client, ids, max_tokens=len(ids))
    assert tokens_of(chunks) == ids
    assert text_of(chunks) == TEXT
    assert not any("\ufffd" in c.get("text", "") for c in chunks)
    assert [c.get("finish_reason") for c in chunks].count("length") == 1
    assert chunks[-1]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == len(ids)


async def test_max_tokens_ends_with_length(namespace, spawn, make_runtime, tiny_model, ids):
    _, client = await serve(namespace, spawn, make_runtime, tiny_model)
    chunks = await generate(client, ids, max_tokens=5, stop=[STOP])
    assert tokens_of(chunks) == ids[:5] and text_of(chunks) == TEXT[: len(text_of(chunks))]
    assert chunks[-1]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 5


async def test_stop_string_across_tokens_ends_the_stream_early(
    namespace, spawn, make_runtime, tiny_model, ids
):
    proc, client = await serve(namespace, spawn, make_runtime, tiny_model, "--metrics-port", "0")
    k = completing_token(tiny_model, ids, STOP)
    assert k - completing_token(tiny_model, ids, "STOP"[0]) >= 2, (
        "the stop string should span tokens"
    )
    max_tokens = 3 * len(ids)  # the echo engine would repeat the prompt up to this
    chunks = await generate(client, ids, max_tokens=max_tokens, stop=[STOP])
    expected = TEXT[: TEXT.index(STOP)]
    seen = ""
    for chunk in chunks:  # no delta ever carries any part of the stop string
        seen += chunk.get("text", "")
        assert expected.startswith(seen)
    assert seen == expected
    assert [c.get("finish_reason") for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    assert tokens_of(chunks) == ids[:k] and k < max_tokens
    assert chunks[-1]["usage"]["completion_tokens"] == k

    # A stop string is not a cancellation: the client did not stop or kill anything.
    port = system_port(proc)
    body = await asyncio.to_thread(
        lambda: urllib.request.urlopen(
            f"http://127.0.0.1:{port}/metrics", timeout=5
        ).read().decode()
    )
    assert sample(body, "dynamo_component_cancellation_total", model="echo") == 0
    assert sample(body, "dynamo_component_requests_total", model="echo")


async def test_include_stop_str_in_output(namespace, spawn, make_runtime, tiny_model, ids):
    _, client = await serve(namespace, spawn, make_runtime, tiny_model)
    chunks = await generate(client, ids, max_tokens=3 * len(ids), stop=["zzz", STOP],
                            include_stop_str_in_output=True)
    assert text_of(chunks) == TEXT[: TEXT.index(STOP) + len(STOP)]
    assert chunks[-1]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == completing_token(tiny_model, ids, STOP)


async def test_without_tokenizer_chunks_pass_through(
    namespace, spawn, make_runtime, tiny_model, ids, tmp_path
):
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(tiny_model / "config.json", model / "config.json")
    _, client = await serve(namespace, spawn, make_runtime, model)
    chunks = await generate(client, ids, max_tokens=len(ids), stop=[STOP])
    assert tokens_of(chunks) == ids and not any("text" in c for c in chunks)
    assert chunks[-1]["finish_reason"] == "length"
