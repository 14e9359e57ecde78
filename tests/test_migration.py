"""Request migration through real processes: a worker lost mid-stream (SIGKILL, SIGSTOP) and
the client's stream continues on another, the same text as a fault-free run, usage and finish
right; the limit; requests that cannot be resumed; kv mode's choice by the extended prompt."""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import socket
from pathlib import Path

import openai
import pytest

from dynamo_zmq import errors
from tests.support import waiting
from tests.support.http_calls import get
from tests.support.metrics import metrics_page, sample
from tests.support.migration import (
    LONG,
    MESSAGES,
    PARAMS,
    client_for,
    fleet,
    mocker,
    serving_worker,
)
from tests.support.mocker_fleet import start_frontend
from tests.support.procs import Proc, system_port

#: Chunks the client reads before the serving worker is lost.
BEFORE = 10


def metrics_url(proc: Proc) -> str:
    return f"http://127.0.0.1:{system_port(proc)}"


async def migrations(url: str) -> float:
    return sample(await metrics_page(url), "dynamo_frontend_migrations_total", model="tiny") or 0


async def reference(client: openai.AsyncOpenAI, **params) -> openai.types.chat.ChatCompletion:
    """The same request, fault-free."""
    return await client.chat.completions.create(model="tiny", messages=MESSAGES, **params)


async def stream_losing_worker(client, workers, sig, **params) -> tuple[str, list, Proc]:
    """Stream a chat request; after ``BEFORE`` content chunks send ``sig`` to its worker.
    Returns (text, chunks, the worker lost)."""
    raw = await client.chat.completions.with_raw_response.create(
        model="tiny", messages=MESSAGES, stream=True, stream_options={"include_usage": True},
        **params,
    )
    victim = serving_worker(workers, raw.headers["x-dynamo-worker"])
    chunks = []
    seen = 0
    async for chunk in raw.parse():
        chunks.append(chunk)
        if chunk.choices and chunk.choices[0].delta.content:
            seen += 1
            if seen == BEFORE:
                victim.signal(sig)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks, victim


@pytest.fixture
async def two_workers(namespace, spawn, tiny_model):
    two = await fleet(spawn, namespace, tiny_model, 2)
    async with client_for(two.url) as client:
        yield two.workers, two.url, client


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
async def test_a_stream_whose_worker_is_lost_continues_unchanged(two_workers, sig):
    """SIGKILL (the connection drops) or SIGSTOP (a hang: liveness marks it gone): the client's
    stream goes on on the other worker; its text is the fault-free run's, no token lost or
    repeated, usage and finish reason as if nothing happened."""
    workers, url, client = two_workers
    ref = await reference(client, **PARAMS)
    assert ref.usage.completion_tokens == LONG and ref.choices[0].finish_reason == "length"
    try:
        text, chunks, _ = await stream_losing_worker(client, workers, sig, **PARAMS)
    finally:
        if sig == signal.SIGSTOP:  # a frozen process ignores the fixture's SIGTERM
            for w in workers:
                w.signal(signal.SIGKILL)
    assert text == ref.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks
              if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    usage = chunks[-1].usage
    assert usage.completion_tokens == LONG
    assert usage.prompt_tokens == ref.usage.prompt_tokens
    assert usage.total_tokens == ref.usage.prompt_tokens + LONG
    assert await migrations(url) == 1
    page = await metrics_page(url)
    assert sample(page, "dynamo_frontend_migrations_total", reason="Disconnected") == 1


async def test_logprobs_go_on_unchanged_after_a_migration(two_workers):
    """The logprobs of a stream whose worker is lost are the fault-free run's: one entry per
    token, none lost, none repeated for the replayed tokens (issue 15, logprobs)."""
    workers, url, client = two_workers
    params = {**PARAMS, "logprobs": True, "top_logprobs": 2}
    ref = await reference(client, **params)
    want = [e.model_dump() for e in ref.choices[0].logprobs.content]
    assert len(want) == LONG
    text, chunks, _ = await stream_losing_worker(client, workers, signal.SIGKILL, **params)
    got = [e.model_dump() for c in chunks if c.choices and c.choices[0].logprobs
           for e in c.choices[0].logprobs.content]
    assert text == ref.choices[0].message.content
    assert got == want
    assert await migrations(url) == 1


async def test_a_non_streaming_request_whose_worker_dies_completes(two_workers):
    workers, url, client = two_workers
    ref = await reference(client, **PARAMS)
    task = asyncio.create_task(reference(client, **PARAMS))
    victim = await first_tokens_on(workers)
    victim.signal(signal.SIGKILL)
    resp = await task
    assert resp.choices[0].message.content == ref.choices[0].message.content
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == LONG
    assert resp.usage.prompt_tokens == ref.usage.prompt_tokens
    assert await migrations(url) == 1


async def first_tokens_on(workers: list[Proc], timeout: float = 20.0) -> Proc:
    """The worker whose request has produced its first tokens (a few of them), by its
    metrics: its time-to-first-token was observed once more than at the start."""
    urls = [metrics_url(w) for w in workers]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout

    async def counts() -> list[float]:
        pages = [(await asyncio.to_thread(get, f"{u}/metrics"))[1].decode() for u in urls]
        return [sample(p, "dynamo_component_time_to_first_token_seconds_count") or 0
                for p in pages]

    before = await counts()
    while True:
        now = await counts()
        for w, b, n in zip(workers, before, now, strict=True):
            if n > b:
                await asyncio.sleep(0.3)  # a few more tokens: some have reached the client
                return w
        assert loop.time() < deadline, "no worker produced a token"
        await asyncio.sleep(0.05)


async def test_no_migration_with_limit_zero(namespace, spawn, tiny_model):
    """``--migration-limit 0``: today's behaviour, the stream fails with the worker."""
    f = await fleet(spawn, namespace, tiny_model, 2, frontend_args=("--migration-limit", "0"))
    workers, url = f.workers, f.url
    async with client_for(url) as client:
        with pytest.raises(openai.APIError) as exc:
            await stream_losing_worker(client, workers, signal.SIGKILL, **PARAMS)
    assert exc.value.body["code"] == "disconnected"
    assert exc.value.body["type"] == "service_unavailable_error"  # 503's kind: retryable
    assert await migrations(url) == 0


async def test_the_advertised_limit_wins_and_a_second_loss_fails(namespace, spawn, tiny_model):
    """Workers advertise ``--migration-limit 1`` (the frontend's default is 3): the first loss
    migrates, the second fails the stream with a retryable error."""
    f = await fleet(spawn, namespace, tiny_model, 3, "--migration-limit", "1")
    workers, url = f.workers, f.url
    async with client_for(url) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="tiny", messages=MESSAGES, stream=True, **PARAMS
        )
        first = serving_worker(workers, raw.headers["x-dynamo-worker"])
        seen = 0
        with pytest.raises(openai.APIError) as exc:
            async for chunk in raw.parse():
                if chunk.choices and chunk.choices[0].delta.content:
                    seen += 1
                    if seen == BEFORE:
                        first.signal(signal.SIGKILL)
                    elif seen == 2 * BEFORE:
                        assert await migrations(url) == 1
                        (await busy(w for w in workers if w is not first)).signal(signal.SIGKILL)
    assert exc.value.body["code"] == "disconnected"
    assert exc.value.body["type"] == "service_unavailable_error"
    assert await migrations(url) == 1


async def busy(workers) -> Proc:
    """The one worker with a request in flight."""
    for w in workers:
        page = (await asyncio.to_thread(get, f"{metrics_url(w)}/metrics"))[1].decode()
        if sample(page, "dynamo_component_inflight_requests", model="tiny") == 1:
            return w
    raise AssertionError("no worker serves the request")


async def test_a_request_that_cannot_be_resumed_fails_clearly(two_workers):
    """A frequency penalty counts generated tokens, which a resumed request would see as
    prompt: the stream ends with a retryable 503-kind error saying so, not a wrong text."""
    workers, url, client = two_workers
    with pytest.raises(openai.APIError) as exc:
        await stream_losing_worker(client, workers, signal.SIGKILL, frequency_penalty=0.5,
                                   **PARAMS)
    body = exc.value.body
    assert body["code"] == "engine_shutdown" and body["type"] == "service_unavailable_error"
    lost_after = re.search(r"lost after (\d+) tokens", body["message"])
    assert lost_after and int(lost_after.group(1)) >= BEFORE, body["message"]
    assert "cannot be resumed" in body["message"] and "penalt" in body["message"]
    assert await migrations(url) == 0


def mocker_tokens(model_dir: Path, prompt: list[int], n: int, seed: int = 0) -> list[int]:
    """What the mocker generates for ``prompt`` (its sampler: uniform, seeded by the prompt)."""
    from engines.mocker._sequence import sequence_seed

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(sequence_seed(seed, prompt))
    return [rng.randrange(vocab) for _ in range(n)]


async def test_kv_mode_migrates_where_the_extended_prompt_is_cached(namespace, spawn, tiny_model):
    """Three workers, kv routing. While request R streams on X, a request whose prompt is R's
    prompt plus R's next 60 tokens goes to Y (X is loaded, nobody has R's prompt cached: it is
    shorter than a block) and leaves them in Y's cache. X dies: R's continuation (its prompt
    extended by the tokens generated) goes to Y, where it overlaps, not to Z."""
    f = await fleet(spawn, namespace, tiny_model, 3, "--block-size", "16", mode="kv")
    workers, url = f.workers, f.url
    prompt = list(range(100, 110))
    ahead = mocker_tokens(tiny_model, prompt, 60)
    async with client_for(url) as client:
        raw = await client.completions.with_raw_response.create(
            model="tiny", prompt=prompt, max_tokens=LONG, stream=True,
            extra_body={"ignore_eos": True},
        )
        x = serving_worker(workers, raw.headers["x-dynamo-worker"])
        warm = await client.completions.with_raw_response.create(
            model="tiny", prompt=prompt + ahead, max_tokens=1, extra_body={"ignore_eos": True},
        )
        y = serving_worker(workers, warm.headers["x-dynamo-worker"])
        assert y is not x, "the warming request should avoid the loaded worker"
        (z,) = [w for w in workers if w is not x and w is not y]
        seen, finish = 0, []
        async for chunk in raw.parse():
            if chunk.choices[0].text:
                seen += 1
                if seen == 40:  # 50 tokens: 3 full blocks of the extended prompt are Y's
                    x.signal(signal.SIGKILL)
            if chunk.choices[0].finish_reason:
                finish.append(chunk.choices[0].finish_reason)
        assert finish == ["length"]
        assert await migrations(url) == 1
    counts = []
    for w in (y, z):
        page = (await asyncio.to_thread(get, f"{metrics_url(w)}/metrics"))[1].decode()
        counts.append(sample(page, "dynamo_component_requests_total", model="tiny"))
    assert counts[0] == 2 and not counts[1], counts  # Y: the warming request and R's rest


async def test_a_worker_shut_down_mid_stream_hands_the_rest_over(namespace, spawn, tiny_model):
    """SIGTERM with a graceful timeout shorter than the stream: the worker cuts the stream off
    when its timeout passes, and the rest comes from the other worker."""
    f = await fleet(spawn, namespace, tiny_model, 2, "--graceful-timeout", "0.5")
    workers, url = f.workers, f.url
    async with client_for(url) as client:
        ref = await reference(client, **PARAMS)
        text, chunks, victim = await stream_losing_worker(client, workers, signal.SIGTERM,
                                                          **PARAMS)
    assert victim.wait() == 0  # a clean shutdown
    assert text == ref.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == LONG
    assert await migrations(url) == 1


async def test_a_worker_restarted_on_its_port_takes_the_rest(namespace, spawn, tiny_model):
    """The only worker dies mid-stream and a new one starts on the same address: the stream
    waits for it (a bounded wait) and continues there."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = ("--port", str(s.getsockname()[1]))
    f = await fleet(spawn, namespace, tiny_model, 1, *port)
    workers, url = f.workers, f.url
    async with client_for(url) as client:
        ref = await reference(client, **PARAMS)
        raw = await client.chat.completions.with_raw_response.create(
            model="tiny", messages=MESSAGES, stream=True, **PARAMS
        )
        texts, seen = [], 0
        async for chunk in raw.parse():
            texts.append(chunk.choices[0].delta.content or "")
            if texts[-1]:
                seen += 1
                if seen == BEFORE:
                    workers[0].signal(signal.SIGKILL)
                    workers[0].wait()
                    workers.append(mocker(spawn, namespace, tiny_model, *port))
    assert "".join(texts) == ref.choices[0].message.content
    assert await migrations(url) == 1


async def test_engine_shutdown_mid_stream_migrates(namespace, spawn, tiny_model):
    """A worker whose engine ends a stream with ``EngineShutdown`` after some tokens: the rest
    comes from the other worker, the same text as the request served whole there."""
    f = await fleet(spawn, namespace, tiny_model, 1)
    (whole,), url = f.workers, f.url
    async with client_for(url) as client:
        ref = await reference(client, **PARAMS)  # served whole
        ending = mocker(spawn, namespace, tiny_model, "--engine",
                        "tests.support.engines:ShuttingDownMocker", "--shutdown-after", "10")
        await waiting.serving(f.front, [whole, ending])
        runs = []
        for _ in range(4):  # round-robin: until one starts on the worker that ends it
            raw = await client.chat.completions.with_raw_response.create(
                model="tiny", messages=MESSAGES, **PARAMS)
            runs.append((serving_worker([ending, whole], raw.headers["x-dynamo-worker"]),
                         raw.parse()))
            if runs[-1][0] is ending:
                break
    assert runs[-1][0] is ending
    for _, resp in runs:
        assert resp.choices[0].message.content == ref.choices[0].message.content
        assert resp.usage.completion_tokens == LONG
        assert resp.choices[0].finish_reason == "length"
    page = await metrics_page(url)
    assert sample(page, "dynamo_frontend_migrations_total", reason="EngineShutdown") == 1


async def test_a_worker_serves_a_continuation_with_the_original_usage(
    namespace, spawn, make_runtime, tiny_model
):
    """On the wire: a continuation's usage counts its resumed tokens as output, and a
    ``resume`` that claims more tokens than the prompt has, or fewer than none, is refused."""
    proc = mocker(spawn, namespace, tiny_model)
    client = await (
        make_runtime(static=(proc.address,)).endpoint(f"{namespace}.backend.generate").client()
    )
    await client.wait_for_instances(timeout=15)

    async def run(**fields) -> list[dict]:
        req = {"token_ids": [5, 6, 7, 8, 9], "stop": {"max_tokens": 2}, **fields}
        return [r.data() async for r in await client.generate(req)]

    end = (await run(resume={"generated": 3}))[-1]
    assert end["finish_reason"] == "length"
    assert (end["usage"]["prompt_tokens"], end["usage"]["completion_tokens"]) == (2, 5)
    assert end["usage"].get("cached_tokens", 0) <= 2
    for bad in ({"generated": 6}, {"generated": -1}):
        with pytest.raises(errors.InvalidArgument):
            await run(resume=bad)


async def test_a_request_lost_before_any_output_with_no_other_worker_waits_for_one(
    namespace, spawn, tiny_model
):
    """The only worker dies before the first output (a long prefill), so the runtime's failover
    has nowhere to go: the request is sent again, unchanged, once a worker is back."""
    def echo(*extra: str) -> Proc:
        return spawn("-m", "dynamo_zmq.worker", "--engine", "tests.support.engines:EchoEngine",
                     "--model-path", str(tiny_model), "--model-name", "echo", "--namespace",
                     namespace, "--host", "127.0.0.1", *extra)

    first = echo("--echo-first-delay", "60")
    url = await waiting.serving(start_frontend(spawn, namespace, mode=None), [first], "echo")
    async with client_for(url) as client:
        task = asyncio.create_task(
            client.completions.create(model="echo", prompt="hello world", max_tokens=6)
        )
        await asyncio.sleep(1.0)  # the request is on the worker, in its "prefill"
        assert not task.done()
        first.signal(signal.SIGKILL)
        first.wait()
        second = echo()
        resp = await asyncio.wait_for(task, 30)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 6
    page = await metrics_page(url)
    assert sample(page, "dynamo_frontend_migrations_total", model="echo") == 1
    del second
