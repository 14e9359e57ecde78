"""Per-tenant limits (issue 35 item 4) through a real frontend and a mocker worker: the
``openai`` client for what a client sees, raw httpx for the headers. Limits are chosen so the
outcomes do not depend on timing: a request bucket of 2 refilled at 0.01/s (the third request
within 100 s is refused), a token budget of 300/min (5 tokens a second) against reservations of
~250. The bucket arithmetic on its own is tests/test_tenant_buckets.py."""

from __future__ import annotations

import asyncio
import hashlib
import uuid

import httpx
import openai
import pytest

from tests.support.metrics import metrics_page, sample
from tests.support.mocker_fleet import start_frontend
from tests.support.procs import Proc, run_cli
from tests.support.waiting import eventually, wait_models

pytestmark = [pytest.mark.asyncio(loop_scope="module")]

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
RATES = """
[default]
requests_per_second = 0.01
burst = 2

[tenants.tok]
tokens_per_minute = 300

[tenants.free]
"""


@pytest.fixture(scope="module")
def worker(tiny_model):
    """One mocker worker serving 'tiny' (chat, completions and embeddings) in a namespace of
    this module's; yields the namespace."""
    namespace = f"t{uuid.uuid4().hex[:12]}"
    proc = Proc(["-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path",
                 str(tiny_model), "--model-name", "tiny", "--namespace", namespace, "--host",
                 "127.0.0.1", "--speedup-ratio", "1000", "--mock-embedding-dim", "8"])
    try:
        proc.wait_ready(60)
        yield namespace
    finally:
        proc.stop()


def client(url: str, tenant: str | None = None, key: str = "none") -> openai.AsyncOpenAI:
    headers = {} if tenant is None else {"x-dynamo-tenant": tenant}
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0,
                              default_headers=headers, timeout=30)


async def chat(url: str, tenant: str | None = None, key: str = "none", **extra) -> object:
    """A chat completion (a streamed one read to its end: its chunks)."""
    async with client(url, tenant, key) as c:
        resp = await c.chat.completions.create(**{**CHAT, **extra})
        if extra.get("stream"):
            return [chunk async for chunk in resp]
        return resp


async def rate_limited(call) -> dict:
    """The body of the 429 ``call`` raises, checked to be OpenAI's error shape."""
    with pytest.raises(openai.RateLimitError) as info:
        await call
    assert info.value.status_code == 429
    body = info.value.body
    assert set(body) == {"message", "type", "param", "code"}, body
    assert body["code"] == "rate_limit_exceeded"
    return body


async def post(url: str, path: str, body: dict, headers: dict) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as c:
        return await c.post(url + path, json=body, headers=headers)


async def test_requests_per_second_per_tenant(worker, spawn, tmp_path):
    limits = tmp_path / "limits.toml"
    limits.write_text(RATES)
    url = start_frontend(spawn, worker, "--tenant-limits", str(limits), mode=None,
                         ready=True).address
    await wait_models(url, {"tiny"})

    # A burst of 2, then 429 in OpenAI's shape, type "requests", with Retry-After.
    for _ in range(2):
        assert (await chat(url, "alice")).choices[0].finish_reason == "length"
    body = await rate_limited(chat(url, "alice"))
    assert body["type"] == "requests" and "'alice'" in body["message"]
    resp = await post(url, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1},
                      {"x-dynamo-tenant": "alice"})
    assert resp.status_code == 429 and resp.json()["error"]["type"] == "requests"
    assert 1 <= int(resp.headers["retry-after"]) <= 100  # one request per 100 s

    # Other tenants have budgets of their own: bob, the anonymous tenant, a listed one.
    for tenant in ("bob", "bob", None, None, "free", "free", "free"):
        assert (await chat(url, tenant)).choices[0].finish_reason == "length", tenant
    await rate_limited(chat(url, "bob"))

    # Embeddings count as requests too.
    async with client(url, "carol") as c:
        for _ in range(2):
            assert len((await c.embeddings.create(model="tiny", input="x")).data) == 1
        with pytest.raises(openai.RateLimitError):
            await c.embeddings.create(model="tiny", input="x")

    # A tenant header that is not a name is a 400 naming it.
    resp = await post(url, "/v1/chat/completions", CHAT, {"x-dynamo-tenant": "no spaces"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "x-dynamo-tenant"


async def test_tokens_are_reserved_at_admission_and_settled_at_the_end(worker, spawn,
                                                                        tmp_path):
    limits = tmp_path / "limits.toml"
    limits.write_text(RATES)
    url = start_frontend(spawn, worker, "--tenant-limits", str(limits), mode=None,
                         ready=True).address
    await wait_models(url, {"tiny"})
    prompt = {"model": "tiny", "prompt": "tenants", "seed": 7}

    # Without max_tokens a request reserves the context left (2048 - prompt), more than the
    # whole budget: refused as never fitting, with no Retry-After (and no client retry).
    async with client(url, "tok") as c:
        body = await rate_limited(c.completions.create(**prompt))
    assert body["type"] == "tokens" and "never fit" in body["message"], body
    resp = await post(url, "/v1/completions", prompt, {"x-dynamo-tenant": "tok"})
    assert resp.status_code == 429 and "retry-after" not in resp.headers
    assert resp.headers["x-should-retry"] == "false"

    # A request that stops early (a stop string from the mocker's deterministic output: an
    # unlimited tenant reads it) gives back the unused part of its reservation...
    async with client(url, "free") as c:
        text = (await c.completions.create(**prompt, max_tokens=250, extra_body={
            "ignore_eos": True})).choices[0].text
    stop = text[4:12]
    assert stop.strip(), text
    async with client(url, "tok") as c:
        short = await c.completions.create(**prompt, max_tokens=250, stop=stop)
        assert short.usage.completion_tokens < 50, short
        # ...so another ~255-token reservation fits at once (without the refund, 300 - 255
        # tokens were left, refilled at 5 a second: it would need 40 s).
        full = await c.completions.create(**prompt, max_tokens=250, extra_body={
            "ignore_eos": True})
        assert full.usage.completion_tokens == 250
        # That one used all it reserved: ~35 tokens are left. A large request is refused
        # (it would need ~35 s of refill) while a small one fits.
        body = await rate_limited(c.completions.create(**prompt, max_tokens=200))
        assert body["type"] == "tokens" and "try again" in body["message"], body
        small = await c.completions.create(**prompt, max_tokens=3)
        assert small.choices[0].finish_reason == "length"
    resp = await post(url, "/v1/completions", {**prompt, "max_tokens": 200},
                      {"x-dynamo-tenant": "tok"})
    assert resp.status_code == 429 and int(resp.headers["retry-after"]) >= 1


async def test_limits_file_is_reread_on_change(worker, spawn, tmp_path):
    limits = tmp_path / "limits.toml"
    limits.write_text("[default]\nrequests_per_second = 0.01\nburst = 1\n")
    front = start_frontend(spawn, worker, "--tenant-limits", str(limits), mode=None,
                           ready=True)
    url = front.address
    await wait_models(url, {"tiny"})
    await chat(url, "dora")
    await rate_limited(chat(url, "dora"))

    # New limits apply without a restart (within a second or two of the change).
    limits.write_text("[default]\nrequests_per_second = 1000\nburst = 1000\n")

    async def admitted() -> bool:
        try:
            await chat(url, "dora")
        except openai.RateLimitError:
            return False
        return True

    await eventually(admitted, timeout=15, what="the new limits", interval=0.3)

    # A file that no longer parses keeps the last good limits, and is logged once.
    limits.write_text("[default]\nrequests_per_second = 'lots'\n")
    await asyncio.sleep(1.5)  # past the frontend's once-a-second look at the file
    for _ in range(5):
        await chat(url, "dora")
        await asyncio.sleep(0.3)
    logs = front.logs()
    assert logs.count("keeping the last good limits") == 1, logs
    assert "requests_per_second must be a number" in logs


@pytest.mark.parametrize(("text", "says"), [
    ("[default]\nburst = 2\n", "burst needs requests_per_second"),
    ("[default\n", "not valid TOML"),
    (None, "cannot read the tenant limits file"),
])
async def test_a_bad_limits_file_at_start_is_exit_2(tmp_path, text, says):
    limits = tmp_path / "limits.toml"
    if text is not None:
        limits.write_text(text)
    res = await asyncio.to_thread(run_cli, "-m", "dynamo_zmq.frontend", "--http-port", "0",
                                  "--tenant-limits", str(limits))
    assert res.returncode == 2 and says in res.stderr and "Traceback" not in res.stderr, res


async def test_api_key_tenants_and_their_metrics(worker, spawn, tmp_path):
    limits = tmp_path / "limits.toml"
    limits.write_text(RATES + '\n[tenants.alpha]\nrequests_per_second = 0.01\nburst = 1\n'
                      'keys = ["sk-alpha"]\n')
    url = start_frontend(spawn, worker, "--tenant-limits", str(limits), "--api-key",
                         "sk-alpha", "--api-key", "sk-beta", mode=None, ready=True).address

    async def listed() -> bool:
        async with client(url, key="sk-beta") as c:
            return "tiny" in {m.id async for m in c.models.list()}

    await eventually(listed, timeout=30, what="model tiny listed")
    beta = "key-" + hashlib.sha256(b"sk-beta").hexdigest()[:12]

    # The key is the tenant: alpha (named in the file) has a burst of 1; beta (not listed)
    # the default's 2. With keys, x-dynamo-tenant names nothing.
    chunks = await chat(url, key="sk-alpha", stream=True, max_tokens=3)
    assert chunks[-1].choices[0].finish_reason == "length"
    body = await rate_limited(chat(url, "beta", key="sk-alpha"))
    assert "'alpha'" in body["message"] and "sk-" not in body["message"]
    for _ in range(2):
        resp = await chat(url, "alpha", key="sk-beta")
        assert resp.usage.completion_tokens == 2
    body = await rate_limited(chat(url, key="sk-beta"))
    assert f"'{beta}'" in body["message"]

    page = await metrics_page_with_key(url, "sk-beta")
    assert "sk-alpha" not in page and "sk-beta" not in page
    requests = "dynamo_frontend_tenant_requests_total"
    assert sample(page, requests, tenant="alpha", outcome="success") == 1
    assert sample(page, requests, tenant="alpha", outcome="rate_limited") == 1
    assert sample(page, requests, tenant=beta, outcome="success") == 2
    assert sample(page, requests, tenant=beta, outcome="rate_limited") == 1
    rejections = "dynamo_frontend_tenant_rejections_total"
    assert sample(page, rejections, tenant="alpha", limit="requests") == 1
    assert sample(page, rejections, tenant=beta, limit="requests") == 1
    tokens = "dynamo_frontend_tenant_tokens_total"
    assert sample(page, tokens, tenant=beta, kind="completion") == 4
    assert sample(page, tokens, tenant="alpha", kind="completion") == 3
    assert sample(page, tokens, tenant=beta, kind="prompt") > 0
    ttft = "dynamo_frontend_tenant_time_to_first_token_seconds_count"
    assert sample(page, ttft, tenant="alpha") == 1 and sample(page, ttft, tenant=beta) == 2
    assert sample(page, "dynamo_frontend_rejected_requests_total", status="429") == 2


async def metrics_page_with_key(url: str, key: str) -> str:
    async with httpx.AsyncClient(timeout=30) as c:
        resp = await c.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"})
    assert resp.status_code == 200
    return resp.text


async def test_without_limits_there_are_no_tenant_series(worker, spawn):
    url = start_frontend(spawn, worker, mode=None, ready=True).address
    await wait_models(url, {"tiny"})
    for _ in range(3):
        await chat(url, "alice")
    assert "dynamo_frontend_tenant_" not in await metrics_page(url)


async def test_a_cancelled_request_settles(worker, spawn, tiny_model, tmp_path):
    """A client that leaves mid-stream is charged what was generated until then; the rest of
    its reservation comes back (the refill alone would take 40 s)."""
    limits = tmp_path / "limits.toml"
    limits.write_text(RATES)
    spawn("-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path", str(tiny_model),
          "--model-name", "slow", "--namespace", worker, "--host", "127.0.0.1",
          "--speedup-ratio", "0.05")  # seconds per a few tokens: the stream is still going
    url = start_frontend(spawn, worker, "--tenant-limits", str(limits), mode=None,
                         ready=True).address
    await wait_models(url, {"tiny", "slow"})
    ask = {"model": "slow", "prompt": "tenants", "max_tokens": 250}
    async with client(url, "tok") as c:
        stream = await c.completions.create(**ask, stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            assert chunk.choices[0].text is not None
            break
        await stream.close()  # the client goes away with ~250 tokens reserved

    async def fits() -> bool:
        async with client(url, "tok") as c:
            try:
                await c.completions.create(**{**ask, "model": "tiny"})
            except openai.RateLimitError:
                return False
            return True

    await eventually(fits, timeout=15, what="the cancelled request's refund", interval=0.2)
    page = await metrics_page(url)
    assert sample(page, "dynamo_frontend_tenant_requests_total", tenant="tok",
                  outcome="disconnected") == 1
