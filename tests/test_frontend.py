"""The OpenAI frontend driven by the real `openai` client against real worker processes."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import signal
import subprocess
import sys

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.http_calls import get, post
from tests.support.metrics import sample
from tests.support.mocker_fleet import ECHO, start_frontend, start_worker
from tests.support.procs import system_port
from tests.support.waiting import wait_models


@pytest.fixture
async def served(namespace, spawn, tiny_model):
    """A mocker worker serving 'tiny' and a frontend; yields (url, openai client)."""
    start_worker(spawn, namespace, tiny_model, ready=True)
    url = start_frontend(spawn, namespace, mode=None, ready=True).address
    await wait_models(url, {"tiny"})
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
        yield url, client


async def test_chat_unary_and_usage(served, tiny_model):
    _, client = served
    resp = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello there"}], max_tokens=7
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert resp.usage.completion_tokens == 7
    assert resp.usage.prompt_tokens > 3 and resp.usage.total_tokens == resp.usage.prompt_tokens + 7
    assert resp.id.startswith("chatcmpl-") and resp.model == "tiny"


async def test_chat_streaming_shape(served):
    _, client = served
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(served, endpoint):
    """``stream_options.continuous_usage_stats`` (vLLM's extension, with ``include_usage``):
    every chunk carries ``usage``, its completion tokens growing to the total; without it only
    the last chunk does."""
    _, client = served

    async def chunks(options: dict) -> list:
        if endpoint == "chat":
            stream = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                stream=True, stream_options=options, extra_body={"ignore_eos": True},
            )
        else:
            stream = await client.completions.create(
                model="tiny", prompt="Hi", max_tokens=6, stream=True, stream_options=options,
                extra_body={"ignore_eos": True},
            )
        return [c async for c in stream]

    got = await chunks({"include_usage": True, "continuous_usage_stats": True})
    assert all(c.usage is not None for c in got), got
    prompt = got[-1].usage.prompt_tokens
    done = [c.usage.completion_tokens for c in got]
    assert done == sorted(done) and done[-1] == 6, done
    assert all(c.usage.prompt_tokens == prompt for c in got)
    assert all(c.usage.total_tokens == prompt + c.usage.completion_tokens for c in got)
    with_text = [c for c in got if c.choices and (
        c.choices[0].delta.content if endpoint == "chat" else c.choices[0].text)]
    assert with_text and with_text[-1].usage.completion_tokens >= 1
    plain = await chunks({"include_usage": True})
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


async def test_completions_stream_and_unary(served):
    _, client = served
    resp = await client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=4)
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 4
    stream = await client.completions.create(model="tiny", prompt="Once", max_tokens=3, stream=True)
    chunks = [c async for c in stream]
    assert [c.choices[0].finish_reason for c in chunks].count("length") == 1
    assert all(c.object == "text_completion" for c in chunks)


async def test_errors_are_openai_shaped(served):
    url, client = served
    with pytest.raises(openai.NotFoundError) as exc:
        await client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "x"}]
        )
    assert "nope" in str(exc.value)
    for extra in ({"n": 129}, {"logprobs": True, "top_logprobs": 21}, {"temperature": 9}):
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2, **extra
            )
    status, body = await asyncio.to_thread(post, f"{url}/v1/chat/completions", b"{not json")
    assert status == 400 and set(json.loads(body)["error"]) >= {"message", "type", "code"}
    status, body = await asyncio.to_thread(
        post, f"{url}/v1/completions",
        json.dumps({"model": "tiny", "prompt": "word " * 5000}).encode(),
    )
    assert status == 413, body


async def test_models_health_metrics(served):
    url, client = served
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    status, body = await asyncio.to_thread(get, f"{url}/health")
    assert status == 200 and "tiny" in json.loads(body)["models"]
    assert (await asyncio.to_thread(get, f"{url}/live"))[0] == 200
    await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    status, body = await asyncio.to_thread(get, f"{url}/metrics")
    text = body.decode()
    for name in ("dynamo_frontend_requests_total", "dynamo_frontend_inflight_requests",
                 "dynamo_frontend_time_to_first_token_seconds",
                 "dynamo_frontend_inter_token_latency_seconds",
                 "dynamo_frontend_input_sequence_tokens", "dynamo_frontend_output_sequence_tokens",
                 "dynamo_frontend_request_duration_seconds"):
        assert f"{name}" in text and 'model="tiny"' in text, name


async def test_stop_strings_are_never_leaked(namespace, spawn, tiny_model):
    """The echo engine streams the prompt back, so the output text is known in advance."""
    start_worker(spawn, namespace, tiny_model, model="echo", engine=ECHO, ready=True)
    url = start_frontend(spawn, namespace, mode=None, ready=True).address
    await wait_models(url, {"echo"})
    text = "the quick brown fox jumps over the lazy dog again and again"
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
        for stop, include in (("fox jum", False), ("lazy", True), (["zzz", "over t"], False)):
            stream = await client.completions.create(
                model="echo", prompt=text, max_tokens=200, stream=True, stop=stop,
                extra_body={"include_stop_str_in_output": include},
            )
            deltas = [c.choices[0].text async for c in stream if c.choices]
            out = "".join(deltas)
            first = min(
                text.find(s) for s in ([stop] if isinstance(stop, str) else stop) if s in text
            )
            matched = next(
                s for s in ([stop] if isinstance(stop, str) else stop) if text.find(s) == first
            )
            expect = text[: first + (len(matched) if include else 0)]
            assert out.strip() == expect.strip()
            if not include:
                assert all(matched not in "".join(deltas[: i + 1]) for i in range(len(deltas)))
        resp = await client.completions.create(model="echo", prompt=text, max_tokens=3)
        assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 3


async def test_client_disconnect_stops_the_engine(namespace, spawn, tiny_model):
    proc = start_worker(spawn, namespace, tiny_model, "--echo-delay", "0.05", "--metrics-port",
                        "0", model="echo", engine=ECHO, ready=True)
    url = start_frontend(spawn, namespace, mode=None, ready=True).address
    await wait_models(url, {"echo"})
    host, port = re.match(r"http://([^:]+):(\d+)", url).groups()
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    body = json.dumps({"model": "echo", "prompt": "word " * 50, "max_tokens": 2000, "stream": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    mport = system_port(proc)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while True:
        _, metrics = await asyncio.to_thread(get, f"http://127.0.0.1:{mport}/metrics")
        page = metrics.decode()
        # The cancellation is counted when the KILL arrives, the request leaves the in-flight
        # gauge when its handler has ended: wait for both.
        if (sample(page, "dynamo_component_cancellation_total", model="echo") == 1
                and sample(page, "dynamo_component_inflight_requests", model="echo") == 0):
            break
        assert loop.time() < deadline, "the worker never saw the cancellation"
        await asyncio.sleep(0.1)


async def test_a_disconnect_ends_a_document_style_handler_as_a_cancellation(
    namespace, spawn, tiny_model
):
    """The cancellation document's handler (``if context.is_stopped(): raise CancelledError``)
    behind the frontend: a client that goes away mid-stream is counted as disconnected (499
    semantics), never as an error or a 503, and the worker counts a cancellation, not a
    failure."""
    proc = start_worker(spawn, namespace, tiny_model, "--metrics-port", "0", model="doc",
                        engine="tests.support.engines:DocumentStopPatternEngine", ready=True)
    front = start_frontend(spawn, namespace, mode=None, ready=True)
    url = front.address
    await wait_models(url, {"doc"})
    host, port = re.match(r"http://([^:]+):(\d+)", url).groups()
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    body = json.dumps({"model": "doc", "prompt": "word " * 20, "max_tokens": 1000,
                       "stream": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")
    conn.sock.close()
    conn.close()
    mport = system_port(proc)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while True:
        _, page = await asyncio.to_thread(get, f"{url}/metrics")
        _, wpage = await asyncio.to_thread(get, f"http://127.0.0.1:{mport}/metrics")
        front_page, worker_page = page.decode(), wpage.decode()
        if (sample(front_page, "dynamo_frontend_disconnected_clients_total", model="doc") == 1
                and sample(worker_page, "dynamo_component_cancellation_total", model="doc") == 1
                and sample(worker_page, "dynamo_component_inflight_requests", model="doc") == 0):
            break
        assert loop.time() < deadline, (front_page, worker_page)
        await asyncio.sleep(0.1)
    assert sample(front_page, "dynamo_frontend_requests_total", model="doc", endpoint="completions",
                  request_type="stream", status="disconnected") == 1
    assert sample(front_page, "dynamo_frontend_requests_total", model="doc", endpoint="completions",
                  request_type="stream", status="error") in (None, 0)
    assert not [line for line in worker_page.splitlines()
                if line.startswith("dynamo_component_errors_total{") and 'model="doc"' in line
                and not line.endswith(" 0.0")], worker_page
    logs = front.logs() + proc.logs()
    assert "EngineShutdown" not in logs and "Traceback" not in logs, logs


async def test_dead_worker_gives_503_and_a_new_one_serves(namespace, spawn, tiny_model):
    first = start_worker(spawn, namespace, tiny_model, ready=True)
    url = start_frontend(spawn, namespace, mode=None, ready=True).address
    await wait_models(url, {"tiny"})
    body = json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    ).encode()
    assert (await asyncio.to_thread(post, f"{url}/v1/chat/completions", body))[0] == 200
    first.signal(signal.SIGKILL)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while (status := (await asyncio.to_thread(post, f"{url}/v1/chat/completions", body))[0]) != 503:
        assert status == 200 and loop.time() < deadline
    start_worker(spawn, namespace, tiny_model, ready=True)
    deadline = loop.time() + 30
    while (status := (await asyncio.to_thread(post, f"{url}/v1/chat/completions", body))[0]) != 200:
        assert status == 503 and loop.time() < deadline
        await asyncio.sleep(0.1)


async def test_two_models_side_by_side(namespace, spawn, tiny_model):
    start_worker(spawn, namespace, tiny_model, model="alpha", ready=True)
    start_worker(spawn, namespace, tiny_model, model="beta", engine=ECHO, ready=True)
    url = start_frontend(spawn, namespace, mode=None, ready=True).address
    await wait_models(url, {"alpha", "beta"})
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
        for _ in range(4):
            b = await client.completions.create(model="beta", prompt="hello world", max_tokens=20)
            assert b.choices[0].text.startswith("hello worldhello world")  # only echo answers beta
            a = await client.completions.create(model="alpha", prompt="hello world", max_tokens=5)
            assert a.usage.completion_tokens == 5


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
FIELDS = ["model", "messages", "prompt", "max_tokens", "temperature", "stream", "stop", "n",
          "top_p", "stream_options", "seed", "max_completion_tokens", "min_tokens", "logprobs",
          "tools"]


@st.composite
def bodies(draw):
    kind = draw(st.sampled_from(["bytes", "json", "fields"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "json":
        return json.dumps(draw(JSON_VALUES), allow_nan=True).encode()
    body = {
        k: draw(JSON_VALUES)
        for k in draw(st.lists(st.sampled_from(FIELDS), max_size=6, unique=True))
    }
    if draw(st.booleans()):
        body["model"] = "tiny"
    raw = json.dumps(body, allow_nan=True).encode()
    return raw[: draw(st.integers(0, len(raw)))] if draw(st.booleans()) else raw


async def test_malformed_bodies_never_500(served):
    url, _ = served

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=bodies(), path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    def check(body, path):
        status, payload = post(url + path, body)
        assert status in (200, 400, 404, 413), (status, body, payload)
        if status != 200:
            assert set(json.loads(payload)["error"]) >= {"message", "type"}

    await asyncio.to_thread(check)
    # and the frontend still serves
    assert (await asyncio.to_thread(get, f"{url}/v1/models"))[0] == 200


async def test_cached_prompt_tokens_are_reported(served):
    """The second request with the same long prompt hits the mocker's prefix cache."""
    _, client = served
    prompt = "shared prefix words " * 60
    first = await client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    second = await client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 64


@pytest.mark.parametrize(("flags", "message"), [
    (["--namespace", "a.b"], "namespace name 'a.b' must be non-empty, without dots"),
    (["--http-port", "70000"], "--http-port must be 0-65535"),
    (["--request-timeout", "nan"], "--request-timeout must be a finite number > 0"),
    (["--request-timeout", "-1"], "--request-timeout must be a finite number > 0"),
    (["--static-file", "/nonexistent/peers.txt"], "cannot read static discovery file"),
    (["--migration-limit", "-1"], "--migration-limit must be >= 0"),
])
def test_bad_flags_are_usage_errors(flags, message):
    res = subprocess.run(
        [sys.executable, "-m", "dynamo_zmq.frontend", "--discovery", "static", *flags],
        capture_output=True, text=True, timeout=60,
    )
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr


def test_a_taken_http_port_is_a_clear_error_not_a_traceback(taken_port):
    port = taken_port
    res = subprocess.run([sys.executable, "-m", "dynamo_zmq.frontend", "--discovery", "static",
                          "--http-port", str(port)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, res.stderr
    assert f"cannot serve HTTP on 127.0.0.1:{port}" in res.stderr and "Traceback" not in res.stderr
