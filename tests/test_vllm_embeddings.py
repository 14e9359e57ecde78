"""``/v1/embeddings`` with a real vLLM worker on vLLM's pooling runner (``--runner pooling
--convert embed``, the tiny random Llama as an embedding model), through a real frontend and
the `openai` client: the model's dimension, one vector per input with its index, equal to what
vLLM itself gives for the same tokens, base64 equal to the floats, usage; the embedding model
is listed and refuses chat with 400 naming it.

Runs only where vLLM is installed (skipped otherwise, failed in CI: see tests/test_vllm.py).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

import tests.support.needs_vllm  # noqa: F401  (skips this module without vLLM; fails it in CI)

# isort: split

import openai
import pytest_asyncio
from tokenizers import Tokenizer

from dynamo_zmq import errors
from dynamo_zmq.llm import EmbeddingOptions, PreprocessedRequest, StopConditions
from tests.conftest import runtime_factory
from tests.support.procs import pythonpath
from tests.support.vllm_stack import MAX_MODEL_LEN, VLLM_ENV, WORKER_START, vllm_stack, wait_models

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

POOLING = ("--runner", "pooling", "--convert", "embed")
TEXTS = ["hello world", "an entirely different sentence", "hello world"]

#: vLLM's own embeddings of token-id prompts (argv[1]: model dir, stdin: JSON list of lists).
_REFERENCE = f"""
import json, sys
from vllm import LLM
llm = LLM(model=sys.argv[1], runner="pooling", convert="embed", dtype="float32",
          max_model_len={MAX_MODEL_LEN}, enforce_eager=True, block_size=32,
          distributed_executor_backend="uni")
prompts = [{{"prompt_token_ids": ids}} for ids in json.load(sys.stdin)]
print("RESULT " + json.dumps([o.outputs.embedding for o in llm.embed(prompts)]))
"""


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory):
    """The tiny model declared a matryoshka model (``is_matryoshka``: any ``dimensions``)."""
    out = tmp_path_factory.mktemp("matryoshka") / "model"
    shutil.copytree(tiny_model, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    return out


@pytest.fixture(scope="module")
def stack(model_dir):
    """One vLLM pooling worker ('embed', the matryoshka tiny model) and a frontend."""
    with vllm_stack(model_dir, "embed", POOLING) as stack:
        yield stack.url, stack.worker.address, stack.namespace


@pytest.fixture
async def client(stack):
    url = stack[0]
    await wait_models(url, names=("embed",))
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as c:
        yield c


@pytest_asyncio.fixture(loop_scope="module")
async def make_runtime():
    async with runtime_factory() as make:
        yield make


def reference(tiny_model, prompts: list[list[int]]) -> list[list[float]]:
    env = {**os.environ, **VLLM_ENV, "PYTHONPATH": pythonpath()}
    done = subprocess.run([sys.executable, "-c", _REFERENCE, str(tiny_model)], env=env,
                          input=json.dumps(prompts), capture_output=True, text=True,
                          timeout=WORKER_START, check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])  # type: ignore[no-any-return]


async def test_embeddings_equal_vllm_own(client, tiny_model, model_dir):
    hidden = json.loads((tiny_model / "config.json").read_text())["hidden_size"]
    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    ids = [tokenizer.encode(t).ids for t in TEXTS]
    resp = await client.embeddings.create(model="embed", input=[*TEXTS, [5, 6, 7, 8]],
                                          encoding_format="float")
    assert resp.model == "embed" and [d.index for d in resp.data] == [0, 1, 2, 3]
    assert all(len(d.embedding) == hidden for d in resp.data)
    vectors = [d.embedding for d in resp.data]
    assert vectors[0] == pytest.approx(vectors[2], abs=1e-5)
    assert vectors[0] != pytest.approx(vectors[1], abs=1e-3)
    assert resp.usage.prompt_tokens == sum(map(len, ids)) + 4 == resp.usage.total_tokens
    expected = reference(model_dir, [*ids, [5, 6, 7, 8]])
    for got, want in zip(vectors, expected, strict=True):
        assert got == pytest.approx(want, abs=1e-4)
    # The openai client's default: base64 on the wire, decoded by the client.
    packed = await client.embeddings.create(model="embed", input=TEXTS[:2])
    for got, want in zip(packed.data, resp.data[:2], strict=True):
        assert got.embedding == pytest.approx(want.embedding, abs=1e-6)


async def test_embedding_model_is_listed_and_refuses_generation(client):
    models = await client.models.list()
    assert "embed" in {m.id for m in models.data}
    with pytest.raises(openai.BadRequestError) as chat:
        await client.chat.completions.create(
            model="embed", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert "embed" in chat.value.message and "vllm" in chat.value.message
    assert chat.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as bad:
        await client.embeddings.create(model="embed", input=[1, -3])
    assert bad.value.body["param"] == "input"


async def test_dimensions_of_a_matryoshka_model_truncate_and_renormalise(client):
    """vLLM truncates a matryoshka model's embedding to ``dimensions`` and renormalises it;
    out of range is vLLM's 400 naming the request. (A model that is not matryoshka: 400 naming
    ``dimensions`` and the engine, tests/test_embeddings.py.)"""
    full = await client.embeddings.create(model="embed", input="hello world",
                                          encoding_format="float")
    cut = await client.embeddings.create(model="embed", input="hello world", dimensions=16,
                                         encoding_format="float")
    head = full.data[0].embedding[:16]
    norm = math.sqrt(sum(v * v for v in head))
    assert len(cut.data[0].embedding) == 16
    assert cut.data[0].embedding == pytest.approx([v / norm for v in head], abs=1e-5)
    with pytest.raises(openai.BadRequestError) as wide:
        await client.embeddings.create(model="embed", input="x", dimensions=10_000)
    assert "dimensions" in wide.value.message


async def test_the_pooling_worker_refuses_generation_and_embeds_on_its_endpoint(
    stack, make_runtime, tiny_model
):
    """Straight to the worker's generate endpoint (no frontend): a generation request gets
    InvalidArgument saying the model is an embedding model; an embedding request one terminal
    with the vector and the prompt's usage."""
    _, address, namespace = stack
    client = await make_runtime(static=(address,)).endpoint(
        f"{namespace}.backend.generate").client()
    await client.wait_for_instances(timeout=15)
    with pytest.raises(errors.InvalidArgument, match="embedding model"):
        async for _ in await client.generate(PreprocessedRequest(
                token_ids=[1, 2, 3], stop=StopConditions(max_tokens=2))):
            pass
    outs = [out.data() async for out in await client.generate(
        PreprocessedRequest(token_ids=[5, 6, 7, 8], embedding=EmbeddingOptions()))]
    hidden = json.loads((tiny_model / "config.json").read_text())["hidden_size"]
    assert len(outs) == 1 and outs[0]["finish_reason"] == "stop"
    assert len(outs[0]["embedding"]) == hidden and outs[0]["usage"]["prompt_tokens"] == 4
