"""``/v1/embeddings`` through a real frontend and real mocker workers, driven by the `openai`
client: the mocker's deterministic embeddings (``--mock-embedding-dim``) give one vector per
input with its index, equal for equal inputs, base64 decoding to the same floats, usage counting
the tokens; bad inputs, unknown models, a model whose engine cannot embed and ``dimensions``
are refused as OpenAI refuses them. The vLLM pooling worker: tests/test_vllm_embeddings.py."""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
import math
import re
import struct
import time
import urllib.error
import urllib.request
import uuid

import openai
import pytest
from tokenizers import Tokenizer

from tests.support.http_calls import get, post
from tests.support.metrics import sample
from tests.support.procs import Proc, system_port
from tests.support.waiting import wait_models

pytestmark = [pytest.mark.asyncio(loop_scope="module")]

DIM = 24


@pytest.fixture(scope="module")
def stack(tiny_model):
    """A mocker worker that embeds ('emb'), one that cannot ('plain'), one that embeds slowly
    ('slow', with metrics), a round-robin frontend and a kv-mode one; yields the frontends'
    URLs and the slow worker's metrics URL."""
    namespace = f"t{uuid.uuid4().hex[:12]}"
    common = ["--model-path", str(tiny_model), "--namespace", namespace, "--host", "127.0.0.1",
              "--speedup-ratio", "1000"]
    procs = [
        Proc(["-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-name", "emb",
              "--mock-embedding-dim", str(DIM), *common]),
        Proc(["-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-name", "plain", *common]),
        # Simulated prefill 200x slower than real time: an embedding takes seconds.
        Proc(["-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-name", "slow",
              "--mock-embedding-dim", "4", *common, "--speedup-ratio", "0.005",
              "--metrics-port", "0"]),
        Proc(["-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace", namespace,
              "--router-mode", "kv"]),
        Proc(["-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace", namespace]),
    ]
    try:
        for proc in procs:
            proc.wait_ready(60)
        port = system_port(procs[2])
        yield procs[-1].address, procs[-2].address, f"http://127.0.0.1:{port}/metrics"
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture
async def client(stack):
    url = stack[0]
    await wait_models(url, {"emb", "plain", "slow"})
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as c:
        yield c


def tokens(tiny_model, text: str) -> list[int]:
    return Tokenizer.from_file(str(tiny_model / "tokenizer.json")).encode(text).ids


async def test_batch_of_strings_one_vector_per_input_with_its_index(client, stack, tiny_model):
    texts = ["hello world", "something else entirely", "hello world"]
    resp = await client.embeddings.create(model="emb", input=texts, encoding_format="float")
    assert resp.object == "list" and resp.model == "emb"
    assert [d.index for d in resp.data] == [0, 1, 2]
    assert all(d.object == "embedding" and len(d.embedding) == DIM for d in resp.data)
    assert all(math.isclose(math.hypot(*d.embedding), 1.0, rel_tol=1e-6) for d in resp.data)
    first, other, again = (d.embedding for d in resp.data)
    assert first == again and first != other
    expected = sum(len(tokens(tiny_model, t)) for t in texts)
    assert resp.usage.prompt_tokens == expected == resp.usage.total_tokens
    _, page = await asyncio.to_thread(get, f"{stack[0]}/metrics")
    assert sample(page.decode(), "dynamo_frontend_requests_total", model="emb",
                  endpoint="embeddings", request_type="unary", status="success") >= 1


async def test_token_inputs_embed_as_their_text_does(client, tiny_model):
    ids = tokens(tiny_model, "hello world")
    text = await client.embeddings.create(model="emb", input="hello world",
                                          encoding_format="float")
    one = await client.embeddings.create(model="emb", input=ids, encoding_format="float")
    many = await client.embeddings.create(model="emb", input=[ids, [5, 6, 7]],
                                          encoding_format="float")
    assert one.data[0].embedding == text.data[0].embedding == many.data[0].embedding
    assert many.data[1].embedding != many.data[0].embedding
    assert one.usage.prompt_tokens == len(ids)
    assert many.usage.prompt_tokens == len(ids) + 3


async def test_kv_routing_serves_embeddings_too(client, stack):
    kv_url = stack[1]
    await wait_models(kv_url, {"emb"})
    texts = ["hello world", "x y z"]
    ref = await client.embeddings.create(model="emb", input=texts, encoding_format="float")
    async with openai.AsyncOpenAI(base_url=f"{kv_url}/v1", api_key="none", max_retries=0) as kv:
        got = await kv.embeddings.create(model="emb", input=texts, encoding_format="float")
    assert [d.embedding for d in got.data] == [d.embedding for d in ref.data]
    assert got.usage.prompt_tokens == ref.usage.prompt_tokens


async def test_base64_decodes_to_the_same_floats(client, stack):
    url = stack[0]
    floats = await client.embeddings.create(model="emb", input=["a b", "c"],
                                            encoding_format="float")
    status, body = post(f"{url}/v1/embeddings", json.dumps(
        {"model": "emb", "input": ["a b", "c"], "encoding_format": "base64"}).encode())
    assert status == 200, body
    data = json.loads(body)["data"]
    for item, ref in zip(data, floats.data, strict=True):
        raw = base64.b64decode(item["embedding"])
        decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
        assert len(decoded) == DIM
        assert decoded == pytest.approx(ref.embedding, rel=1e-6, abs=1e-7)
    # The openai client asks for base64 by default and decodes it itself.
    default = await client.embeddings.create(model="emb", input=["a b", "c"])
    for got, ref in zip(default.data, floats.data, strict=True):
        assert got.embedding == pytest.approx(ref.embedding, rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("bad", [[], [[]], [-1, 2], [1.5], [1, "a"], ["a", 3], [["a"]], {"a": 1},
                                 [[1, -2]], 7, None])
async def test_bad_inputs_are_400_naming_input(client, bad):
    with pytest.raises(openai.BadRequestError) as err:
        await client.embeddings.create(model="emb", input=bad, encoding_format="float")
    assert err.value.status_code == 400
    assert err.value.body["param"] == "input", err.value.body


async def test_refusals(client, stack, tiny_model):
    url = stack[0]
    with pytest.raises(openai.NotFoundError) as missing:
        await client.embeddings.create(model="nope", input="x", encoding_format="float")
    assert missing.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as lacks:  # the mocker without embeddings
        await client.embeddings.create(model="plain", input="x", encoding_format="float")
    assert "mocker" in lacks.value.message and lacks.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as dims:  # no matryoshka model
        await client.embeddings.create(model="emb", input="x", dimensions=8,
                                       encoding_format="float")
    assert "mocker" in dims.value.message and dims.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError) as fmt:
        await client.embeddings.create(model="emb", input="x",
                                       encoding_format="hex")  # type: ignore[arg-type]
    assert fmt.value.body["param"] == "encoding_format"
    config = json.loads((tiny_model / "config.json").read_text())
    too_long = [3] * (config["max_position_embeddings"] + 1)
    status, body = post(f"{url}/v1/embeddings",
                        json.dumps({"model": "emb", "input": [[1], too_long]}).encode())
    assert status == 413 and json.loads(body)["error"]["param"] == "input", body
    status, body = post(f"{url}/v1/embeddings", b"{not json")
    assert status == 400, body
    # A model that embeds still generates (the mocker embeds beside generation).
    chat = await client.chat.completions.create(
        model="emb", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.choices[0].message.content is not None


async def _worker_metrics(url: str, cancelled: float, inflight: float) -> None:
    """Wait (bounded) until the slow worker counts ``cancelled`` cancellations and has
    ``inflight`` requests."""
    deadline = time.monotonic() + 20
    while True:
        page = (await asyncio.to_thread(get, url))[1].decode()
        got = (sample(page, "dynamo_component_cancellation_total", model="slow"),
               sample(page, "dynamo_component_inflight_requests", model="slow"))
        if got == (cancelled, inflight):
            return
        assert time.monotonic() < deadline, f"worker metrics stuck at {got}"
        await asyncio.sleep(0.1)


async def test_deadline_and_disconnect_kill_the_workers_embedding(client, stack):
    """The request's deadline answers 504 and kills every input's request on the worker; a
    client that goes away mid-request does too (no response is written)."""
    url, _, metrics = stack
    batch = ["word " * 100, "other " * 100]
    body = json.dumps({"model": "slow", "input": batch}).encode()
    req = urllib.request.Request(
        f"{url}/v1/embeddings", body,
        {"Content-Type": "application/json", "x-dynamo-request-timeout": "0.5"})
    try:
        await asyncio.to_thread(urllib.request.urlopen, req, timeout=30)
        raise AssertionError("the deadline did not end the request")
    except urllib.error.HTTPError as exc:
        assert exc.code == 504, exc.read()
    await _worker_metrics(metrics, cancelled=2, inflight=0)
    host, port = re.match(r"http://([^:]+):(\d+)", url).groups()  # type: ignore[union-attr]
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("POST", "/v1/embeddings", json.dumps({"model": "slow", "input": batch[0]}),
                 {"Content-Type": "application/json"})
    await _worker_metrics(metrics, cancelled=2, inflight=1)
    conn.sock.close()  # the client goes away before the answer
    conn.close()
    await _worker_metrics(metrics, cancelled=3, inflight=0)
    deadline = time.monotonic() + 10
    while True:  # the frontend counts the disconnect once its request has ended
        page = (await asyncio.to_thread(get, f"{url}/metrics"))[1].decode()
        if sample(page, "dynamo_frontend_disconnected_clients_total", model="slow") == 1:
            break
        assert time.monotonic() < deadline, "the frontend never counted the disconnect"
        await asyncio.sleep(0.1)
    assert sample(page, "dynamo_frontend_requests_total", model="slow", endpoint="embeddings",
                  request_type="unary", status="error") == 1  # the 504
    assert sample(page, "dynamo_frontend_inflight_requests", model="slow") == 0
