"""Hostile HTTP input against a real frontend (with an API key) and mocker worker, over raw
sockets (a client library would refuse to send most of it): invalid UTF-8, body limits, bodies
that never finish, and a hypothesis fuzz over every JSON route, the Responses and Messages APIs'
included, and bad API-key headers (``dynamo_zmq.tools.http_fuzz``). Nothing may get a 5xx, go
unanswered or answer an error in another shape than its route's (Anthropic's on the Messages
API), and the frontend keeps serving the real ``openai`` and ``anthropic`` clients afterwards."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import anthropic
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamo_zmq.tools.http_fuzz import Case, error_problem, make_case, send
from tests.support.http_calls import get
from tests.support.metrics import sample
from tests.support.mocker_fleet import start_worker
from tests.support.waiting import wait_models

#: Seconds a body may take to arrive in these tests (``--body-timeout``).
BODY_TIMEOUT = "0.5"
JSON_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
BAD_UTF8 = [b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf5\x80\x80\x80"]
#: The frontend's API key.
KEY = "fuzz-key"
AUTH = (("Authorization", f"Bearer {KEY}"),)


@pytest.fixture
async def served(namespace, spawn, tiny_model):
    """A mocker worker serving 'tiny' (embeddings too) and a frontend with a short body timeout,
    a 2 MiB body cap and an API key; yields (host, port, url, frontend process)."""
    start_worker(spawn, namespace, tiny_model, "--mock-embedding-dim", "8", ready=True)
    proc = spawn("-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace", namespace,
                 "--body-timeout", BODY_TIMEOUT, "--max-body-bytes", str(2 * 2**20),
                 "--api-key", KEY, "--api-key-exempt", "/health,/live,/metrics,/v1/models",
                 ready=False)
    url = proc.wait_ready().address
    await wait_models(url, {"tiny"})
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    yield parts.hostname, parts.port, url, proc


async def still_serves(url: str) -> None:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0,
                                  timeout=30) as client:
        resp = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=3
        )
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 3


async def still_serves_the_new_apis(url: str) -> None:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0,
                                  timeout=30) as client:
        resp = await client.responses.create(model="tiny", input="Hello", max_output_tokens=3)
    assert resp.status == "incomplete" and resp.usage.output_tokens == 3
    async with anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0,
                                        timeout=30) as claude:
        message = await claude.messages.create(
            model="tiny", max_tokens=3, messages=[{"role": "user", "content": "Hello"}])
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3


def openai_error(body: bytes) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


@pytest.mark.parametrize("bad", BAD_UTF8, ids=["ff", "c080", "eda080", "f5"])
@pytest.mark.parametrize("path", JSON_ROUTES)
async def test_invalid_utf8_in_a_string_is_a_400(served, path, bad):
    """Issue 20 item 1: msgspec raises UnicodeDecodeError for these; it is a 400 now."""
    host, port, url, _ = served
    field = {"/v1/chat/completions": b'"messages": [{"role": "user", "content": "a',
             "/v1/completions": b'"prompt": "a', "/v1/embeddings": b'"input": "a'}[path]
    closing = b'"}]}' if path.endswith("chat/completions") else b'"}'
    body = b'{"model": "tiny", ' + field + bad + b'b' + closing
    answer = await send(host, port, Case("utf8", path, body, headers=AUTH))
    assert answer.status == 400, answer
    err = openai_error(answer.body)
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_json"
    assert "UTF-8" in err["message"]
    await still_serves(url)


async def test_a_body_left_short_of_its_length_gets_408_and_the_connection_closes(served):
    """Issue 20 item 5: half the body, then silence: 408 after --body-timeout, in OpenAI's
    error shape, and the frontend closes the connection (the read reaches EOF)."""
    host, port, url, _ = served
    body = b'{"model": "tiny", "prompt": "hello", "max_tokens": 2}'
    reader, writer = await asyncio.open_connection(host, port)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
            f"\r\nAuthorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    writer.write(head + body[: len(body) // 2])
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 30)  # returns at EOF: the frontend closed
    writer.close()
    status_line, _, rest = raw.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 408"), raw
    headers, _, payload = rest.partition(b"\r\n\r\n")
    assert b"connection: close" in headers.lower() and b"chunked" in headers.lower()
    err = openai_error(payload.split(b"\r\n")[1])  # the one chunk
    assert err["code"] == "request_timeout" and err["type"] == "invalid_request_error"
    await still_serves(url)


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"],
                         ids=["nothing", "half-headers"])
async def test_headers_that_never_end_get_408_and_the_connection_closes(served, sent):
    """uvicorn alone keeps such a connection open for ever (its keep-alive timeout starts only
    after a response); the frontend's protocol answers 408 after --body-timeout and closes."""
    host, port, url, _ = served
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(sent)
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 30)  # returns at EOF: the frontend closed
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head, raw
    assert openai_error(payload)["code"] == "request_timeout"
    await still_serves(url)


async def test_a_body_over_the_cap_is_refused_from_its_content_length(served):
    """A Content-Length over --max-body-bytes gets 413 before any of the body is read."""
    host, port, url, _ = served
    answer = await send(host, port, Case("huge", "/v1/completions", b"{", declared=3 * 2**20,
                                         headers=AUTH))
    assert answer.status == 413, answer
    assert openai_error(answer.body)["code"] == "request_too_large"
    await still_serves(url)


@pytest.mark.parametrize("path", JSON_ROUTES)
async def test_a_huge_prompt_is_refused_before_tokenizing(served, path):
    """A 1.5 MB prompt, far over what tiny's 2048-token context can hold (2048 x its longest
    vocabulary entry, in characters), is a 413 naming the characters, not the tokens: it was
    never tokenized."""
    host, port, url, _ = served
    text = "hello world " * 125_000
    body = {"/v1/chat/completions": {"messages": [{"role": "user", "content": text}]},
            "/v1/completions": {"prompt": ["short", text]},
            "/v1/embeddings": {"input": text}}[path]
    answer = await send(host, port, Case("huge", path, json.dumps({"model": "tiny", **body})
                                         .encode(), headers=AUTH))
    assert answer.status == 413, answer
    err = openai_error(answer.body)
    assert err["code"] == "context_length_exceeded" and "characters" in err["message"], err
    _, metrics = await asyncio.to_thread(get, f"{url}/metrics")
    endpoint = {"/v1/chat/completions": "chat", "/v1/completions": "completions",
                "/v1/embeddings": "embeddings"}[path]
    refused = sample(metrics.decode(), "dynamo_frontend_rejected_requests_total",
                     endpoint=endpoint, status="413")
    assert refused == 1
    await still_serves(url)


async def test_fuzzed_bodies_get_no_5xx_and_no_hang(served):
    """Hypothesis draws bodies of every family (``http_fuzz.FAMILIES``) for every route of
    ``http_fuzz.ROUTES`` (the Responses and Messages APIs' included): each is answered, none
    with a 5xx, every error in its route's shape (``error_problem``), and every request without
    an accepted key with 401; then the frontend still serves a chat completion, a response and
    a message. The refusals are counted, and logged as a line now and then, never a
    traceback."""
    host, port, url, proc = served
    loop = asyncio.get_running_loop()
    seen: dict[str, set[int]] = {}
    routes: set[str] = set()

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=False)
    @given(rng=st.randoms(use_true_random=False))
    def check(rng: random.Random) -> None:
        case = make_case(rng, huge_cap=300_000, api_key=KEY)
        answer = asyncio.run_coroutine_threadsafe(send(host, port, case, wait=30), loop).result()
        assert not answer.hung and answer.status is not None, (case, answer)
        assert answer.status < 500, (case, answer)
        path = case.path.split("?")[0]
        shape = "/v1/responses/x" if path.startswith("/v1/responses/") else path
        assert error_problem(shape, answer.status, answer.body) is None, (case, answer)
        if case.family == "auth":
            assert answer.status == 401, (case, answer)
        seen.setdefault(case.family, set()).add(answer.status)
        routes.add(shape)

    await asyncio.to_thread(check)
    assert {"utf8", "depth", "short", "valid", "blocks", "auth", "ids"} <= set(seen), seen
    assert {"/v1/responses", "/v1/responses/x", "/v1/messages",
            "/v1/messages/count_tokens"} <= routes, routes
    await still_serves(url)
    await still_serves_the_new_apis(url)
    _, metrics = await asyncio.to_thread(get, f"{url}/metrics")
    refused = sample(metrics.decode(), "dynamo_frontend_rejected_requests_total", status="400")
    assert refused is not None and refused >= 20
    logs = await asyncio.to_thread(Path(proc.log.name).read_text, errors="replace")  # all
    lines = logs.count("refused a ")
    assert "Traceback" not in logs and 1 <= lines < refused / 4, (lines, refused, logs[-3000:])


@pytest.fixture
async def long_context(namespace, spawn, tiny_model, tmp_path):
    """tiny with a 262,144-token context (so a 2 MB prompt is under its character bound and
    gets tokenized), a mocker worker serving it, and a frontend; yields (host, port, url,
    frontend process)."""
    model = tmp_path / "long"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 262_144}))
    start_worker(spawn, namespace, model, ready=True)
    proc = spawn("-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace", namespace,
                 ready=False)
    url = proc.wait_ready().address
    await wait_models(url, {"tiny"})
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    yield parts.hostname, parts.port, url, proc


async def test_big_prompts_are_tokenized_off_the_event_loop(long_context):
    """Issue 20 item 3: while the frontend tokenizes three 2 MB prompts (over a million tokens
    each: 413 once counted), /live and small chat completions keep being answered, and the
    worker is never declared down. Before, each tokenization held the event loop for seconds,
    so hardly any of them got through until the big ones were done."""
    host, port, url, proc = long_context
    _, health = await asyncio.to_thread(get, f"{url}/health")
    workers = json.loads(health)["models"]["tiny"]
    text = "hello world, the quick brown fox. " * 60_000
    big = [Case("huge", "/v1/completions", json.dumps({"model": "tiny", "prompt": f"{i}{text}",
                                                       "max_tokens": 2}).encode())
           for i in range(3)]
    bigs = [asyncio.create_task(send(host, port, case, wait=120)) for case in big]
    lives = smalls = 0
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                  timeout=60) as client:

        async def small() -> None:
            nonlocal smalls
            while not all(b.done() for b in bigs):
                resp = await client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
                )
                assert resp.usage.completion_tokens == 2
                smalls += not all(b.done() for b in bigs)

        async def live() -> None:
            nonlocal lives
            while not all(b.done() for b in bigs):
                status, _ = await asyncio.to_thread(get, f"{url}/live")
                assert status == 200
                lives += not all(b.done() for b in bigs)

        await asyncio.wait_for(asyncio.gather(small(), small(), live()), 120)
    answers = [b.result() for b in bigs]
    assert [a.status for a in answers] == [413] * 3, answers
    assert all(b"input tokens" in a.body for a in answers), answers  # counted, then refused
    assert lives >= 20 and smalls >= 10, (lives, smalls)
    _, health = await asyncio.to_thread(get, f"{url}/health")
    assert json.loads(health)["models"]["tiny"] == workers
    assert " down: " not in proc.logs()
    await still_serves(url)


@pytest.mark.parametrize(("flags", "message"), [
    (["--body-timeout", "0"], "--body-timeout must be a finite number > 0"),
    (["--body-timeout", "inf"], "--body-timeout must be a finite number > 0"),
    (["--max-body-bytes", "0"], "--max-body-bytes must be >= 1"),
])
def test_bad_limit_flags_are_usage_errors(flags, message):
    res = subprocess.run(
        [sys.executable, "-m", "dynamo_zmq.frontend", "--discovery", "static", *flags],
        capture_output=True, text=True, timeout=60,
    )
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr
