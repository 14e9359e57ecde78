"""Request migration with real vLLM workers: greedy decoding gives the same text whether the
worker serving a stream is killed in its middle (the rest comes from the other vLLM worker,
which prefills the prompt extended by the tokens generated) or not.

Runs only where vLLM is installed (skipped otherwise, failed in CI: see tests/test_vllm.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import uuid

import pytest

try:
    import vllm  # noqa: F401
except ImportError as _exc:  # pragma: no cover - depends on the environment
    _why = f"vLLM is not installed ({_exc}); install the `vllm` extra to run the vLLM tests"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{_why} (CI=true: the vLLM tests must run in CI)", pytrace=False)
    print(f"SKIP tests/test_vllm_migration.py: {_why}", file=sys.stderr)
    pytest.skip(_why, allow_module_level=True)

import openai

from tests.support.http_calls import get
from tests.support.metrics import sample
from tests.support.procs import Proc
from tests.test_vllm import VLLM_ENV, WORKER_FLAGS, WORKER_START

pytestmark = [pytest.mark.timeout(600)]

PROMPT = "Once upon a time there was a worker that"
#: Long enough that the stream is still being generated when its worker is killed.
MAX_TOKENS = 400


async def wait_instances(url: str, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        status, body = await asyncio.to_thread(get, f"{url}/health")
        if status == 200 and len(json.loads(body)["models"].get("tiny", [])) == count:
            return
        assert time.monotonic() < deadline, f"not {count} vLLM instances: {body!r}"
        await asyncio.sleep(0.2)


async def test_greedy_text_is_the_same_when_the_vllm_worker_dies_mid_stream(tiny_model):
    namespace = f"t{uuid.uuid4().hex[:12]}"
    procs: list[Proc] = []
    try:
        workers = [
            Proc(["-m", "dynamo_zmq.worker", "--engine", "vllm", "--model-path", str(tiny_model),
                  "--model-name", "tiny", "--namespace", namespace, "--host", "127.0.0.1",
                  *WORKER_FLAGS], env=VLLM_ENV)
            for _ in range(2)
        ]
        procs.extend(workers)
        front = Proc(["-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace", namespace])
        procs.append(front)
        for w in workers:
            w.wait_ready(WORKER_START)
        url = front.wait_ready(60).address
        await wait_instances(url, 2)
        params = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                  "extra_body": {"ignore_eos": True}}
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                      timeout=300) as client:
            ref = await client.completions.create(**params)
            raw = await client.completions.with_raw_response.create(stream=True, **params)
            iid = int(raw.headers["x-dynamo-worker"].split("/")[0], 16)
            victim = next(w for w in workers if w.instance_id == iid)
            texts, finish = [], []
            async for chunk in raw.parse():
                texts.append(chunk.choices[0].text)
                if len(texts) == 3:
                    victim.signal(signal.SIGKILL)
                if chunk.choices[0].finish_reason:
                    finish.append(chunk.choices[0].finish_reason)
        _, page = await asyncio.to_thread(get, f"{url}/metrics")
        migrated = sample(page.decode(), "dynamo_frontend_migrations_total", model="tiny")
        assert migrated == 1, "the stream ended before its worker was killed: make it longer"
        assert "".join(texts) == ref.choices[0].text
        assert finish == [ref.choices[0].finish_reason] == ["length"]
    finally:
        for proc in procs:
            proc.stop()
