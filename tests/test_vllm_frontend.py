"""The OpenAI frontend in front of a real vLLM worker process, driven by the `openai` client:
streaming and unary, greedy output equal to vLLM's own, stop strings, max_tokens, a client
disconnect aborting the vLLM request, and KV-aware routing fed by vLLM's KV events.

Runs only where vLLM is installed (skipped otherwise, failed in CI: see tests/test_vllm.py).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import time
import uuid

import pytest

import tests.support.needs_vllm  # noqa: F401  (skips this module without vLLM; fails it in CI)

# isort: split

import openai
import pytest_asyncio

from engines.vllm import VllmEngine
from engines.vllm.native import NativeTokenizer
from tests.support.http_calls import get_text
from tests.support.metrics import sample
from tests.support.procs import Proc
from tests.support.vllm_stack import (
    ENGINE_ARGS,
    VLLM_ENV,
    WORKER_FLAGS,
    WORKER_START,
    use_vllm_env,
    wait_models,
)

# vLLM on this CPU, for the engine this module runs in the test process (``reference``).
use_vllm_env()

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

BLOCK = 32


@pytest.fixture(scope="module")
def stack(tiny_model):
    """Two vLLM workers (the default fast path as 'tiny', native processing as 'tiny-native'),
    and two frontends on their namespace: round-robin and KV routing."""
    namespace = f"t{uuid.uuid4().hex[:12]}"
    procs: list[Proc] = []
    try:
        worker = Proc(["-m", "dynamo_zmq.worker", "--engine", "vllm",
                       "--model-path", str(tiny_model),
                       "--model-name", "tiny", "--namespace", namespace, "--host", "127.0.0.1",
                       "--metrics-port", "0", *WORKER_FLAGS], env=VLLM_ENV)
        procs.append(worker)
        # One at a time: each vLLM worker picks free ports for its KV sockets that vLLM binds
        # later, and a process starting meanwhile could take them.
        worker.wait_ready(WORKER_START)
        native = Proc(["-m", "dynamo_zmq.worker", "--engine", "vllm",
                       "--model-path", str(tiny_model),
                       "--model-name", "tiny-native", "--native-processing",
                       "--namespace", namespace, "--host", "127.0.0.1", *WORKER_FLAGS],
                      env=VLLM_ENV)
        procs.append(native)
        native.wait_ready(WORKER_START)
        fronts = {}
        for mode in ("round-robin", "kv"):
            proc = Proc(["-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace", namespace,
                         "--router-mode", mode])
            procs.append(proc)
            fronts[mode] = proc
        for proc in fronts.values():
            proc.wait_ready(60)
        yield worker, {mode: proc.address for mode, proc in fronts.items()}
    finally:
        for proc in procs:
            proc.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reference(tiny_model):
    """vLLM itself (in this process), for the expected greedy outputs."""
    eng = VllmEngine({"model": str(tiny_model), **ENGINE_ARGS})
    await eng.start(1)
    yield eng
    await eng.cleanup()


async def direct(engine: VllmEngine, tokens: list[int], max_tokens: int) -> tuple[str, str]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    final = None
    async for out in engine.llm.generate(TokensPrompt(prompt_token_ids=tokens), params,
                                         f"ref-{time.monotonic_ns()}"):
        final = out
    comp = final.outputs[0]
    return comp.text, str(comp.finish_reason)



@pytest_asyncio.fixture(loop_scope="module")
async def client(stack):
    _, urls = stack
    await wait_models(urls["round-robin"])
    async with openai.AsyncOpenAI(base_url=f"{urls['round-robin']}/v1", api_key="none",
                                  max_retries=0) as c:
        yield c


async def test_completions_greedy_equal_vllm_stream_and_unary(client, reference, tiny_model):
    tok = NativeTokenizer(tiny_model)
    for text in ("Once upon a time there was", "The worker engine said"):
        ids = tok.encode(text)
        expect, reason = await direct(reference, ids, 20)
        resp = await client.completions.create(
            model="tiny", prompt=ids, max_tokens=20, temperature=0
        )
        assert resp.choices[0].text == expect and resp.choices[0].finish_reason == reason
        stream = await client.completions.create(model="tiny", prompt=ids, max_tokens=20,
                                                 temperature=0, stream=True)
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expect
        assert [c.choices[0].finish_reason for c in chunks if c.choices].count(reason) == 1
        # A text prompt is tokenized by the frontend as vLLM tokenizes it.
        resp = await client.completions.create(
            model="tiny", prompt=text, max_tokens=20, temperature=0
        )
        assert resp.choices[0].text == expect and resp.usage.prompt_tokens == len(ids)


async def test_chat_greedy_equal_vllm_stream_and_unary(client, reference, tiny_model):
    messages = [{"role": "user", "content": "Hello there, tell me about water"}]
    ids = NativeTokenizer(tiny_model).apply_chat_template(messages, add_generation_prompt=True)
    expect, reason = await direct(reference, ids, 16)
    resp = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=16,
                                                temperature=0)
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.choices[0].message.content == expect and resp.choices[0].finish_reason == reason
    stream = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=16,
                                                  temperature=0, stream=True,
                                                  stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expect
    assert chunks[-1].usage.prompt_tokens == len(ids)


async def test_stop_strings_and_max_tokens(client, reference, tiny_model):
    ids = NativeTokenizer(tiny_model).encode("water and light over the land")
    full, _ = await direct(reference, ids, 24)
    stop = full.strip()[2:5]
    assert stop and stop in full, full
    for include in (False, True):
        resp = await client.completions.create(
            model="tiny", prompt=ids, max_tokens=24, temperature=0, stop=[stop],
            extra_body={"include_stop_str_in_output": include},
        )
        cut = full.find(stop) + (len(stop) if include else 0)
        assert resp.choices[0].text == full[:cut] and resp.choices[0].finish_reason == "stop"
    resp = await client.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 3


async def test_client_disconnect_aborts_the_vllm_request(stack, client):
    worker, urls = stack
    host, port = re.match(r"http://([^:]+):(\d+)", urls["round-robin"]).groups()
    mport = int(next(line.split()[-1] for line in worker.logs().splitlines()
                     if "metrics and health on port" in line))
    before = await asyncio.to_thread(get_text, f"http://127.0.0.1:{mport}/metrics")
    cancelled = sample(before, "dynamo_component_cancellation_total", model="tiny") or 0
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 400, "stream": True,
                       "ignore_eos": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    deadline = time.monotonic() + 15
    while True:
        metrics = await asyncio.to_thread(get_text, f"http://127.0.0.1:{mport}/metrics")
        if (sample(metrics, "dynamo_component_cancellation_total", model="tiny") == cancelled + 1
                and sample(metrics, "dynamo_component_inflight_requests", model="tiny") == 0):
            break
        assert time.monotonic() < deadline, "the worker never saw the cancellation"
        await asyncio.sleep(0.2)
    # The engine is free again: a new request completes at once.
    out = await client.completions.create(model="tiny", prompt=[1, 2], max_tokens=2,
                                          extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"


async def test_kv_router_routes_a_repeated_prefix_with_a_full_match(stack):
    worker, urls = stack
    url = urls["kv"]
    await wait_models(url)
    prompt = [(5 * i + 3) % 500 + 4 for i in range(7 * BLOCK + 9)]  # 7 full blocks
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as c:
        first = await c.completions.with_raw_response.create(
            model="tiny", prompt=prompt, max_tokens=2
        )
        assert first.headers["x-dynamo-worker"] == f"{worker.instance_id:x}/0"
        # The router learns the prompt's blocks from the worker's KV events.
        deadline = time.monotonic() + 15
        while _counter(await asyncio.to_thread(get_text, f"{url}/metrics"),
                       'dynamo_router_kv_event_batches_total{model="tiny"}') < 1:
            assert time.monotonic() < deadline, "no KV events reached the router"
            await asyncio.sleep(0.2)
        await asyncio.sleep(0.5)
        before = await asyncio.to_thread(get_text, f"{url}/metrics")
        second = await c.completions.with_raw_response.create(
            model="tiny", prompt=prompt, max_tokens=2
        )
        assert second.headers["x-dynamo-worker"] == f"{worker.instance_id:x}/0"
        after = await asyncio.to_thread(get_text, f"{url}/metrics")
    name = 'dynamo_router_matched_blocks_total{model="tiny"}'
    assert _counter(after, name) - _counter(before, name) == 7, after


def _counter(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


async def test_native_processing_and_the_default_agree_on_greedy_requests(stack, client):
    """--native-processing: vLLM's own tokenizer, chat template and detokenizer (through the
    frontend's tokenizer adapter), against our fast path, on the same greedy requests."""
    _, urls = stack
    await wait_models(urls["round-robin"], names=("tiny", "tiny-native"))
    chats = [
        [{"role": "user", "content": "Hello there, tell me about water"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a cat?"}],
    ]
    for messages in chats:
        got = {}
        for model in ("tiny", "tiny-native"):
            resp = await client.chat.completions.create(model=model, messages=messages,
                                                        max_tokens=24, temperature=0)
            got[model] = (resp.choices[0].message.content, resp.choices[0].finish_reason,
                          resp.usage.prompt_tokens)
        assert got["tiny"] == got["tiny-native"]
    for prompt in ("Once upon a time there was", "The worker engine said"):
        texts = set()
        for model in ("tiny", "tiny-native"):
            resp = await client.completions.create(model=model, prompt=prompt, max_tokens=24,
                                                   temperature=0, stop=["zz"])
            texts.add((resp.choices[0].text, resp.choices[0].finish_reason))
        assert len(texts) == 1
