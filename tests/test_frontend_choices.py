"""Several choices per request through the real `openai` client, a real frontend and real workers:
``n > 1`` (chat and completions, streamed and not, usage summed), ``best_of`` (a test engine
with deterministic log-probabilities), ``echo``, a batch of prompts (OpenAI's choice indexes),
what an engine lacks (400 naming it), the mocker's ``logit_bias``, a client going away
mid-stream with ``n=3`` (every sub-request stops on the worker), a failing sub-request, the
deadline, a sub-request migrating on its own, and the sampling options the mocker observes
(``min_tokens``, ``stop_token_ids``, ``seed``)."""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import re
import uuid
from collections import defaultdict

import openai
import pytest
import pytest_asyncio
from tokenizers import Tokenizer

from engines.mocker._sequence import sequence_seed
from tests.support.engines import token_logprob
from tests.support.http_calls import get
from tests.support.metrics import metrics_page, sample
from tests.support.migration import client_for, fleet, mocker
from tests.support.procs import Proc, system_port
from tests.support.waiting import serving, wait_models

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]

ECHO = "tests.support.engines:EchoEngine"
SCORED = "tests.support.engines:ScoredEchoEngine"
CHAT = [{"role": "user", "content": "Tell me a story about a dragon."}]


@pytest.fixture(scope="module")
def stack(tiny_model):
    """Workers on one namespace: the mocker ('tiny'), the echo engine with a delay per token
    ('echo', metrics served) and the scored echo engine ('scored'); one frontend."""
    namespace = f"t{uuid.uuid4().hex[:12]}"
    common = ["-m", "dynamo_zmq.worker", "--model-path", str(tiny_model), "--namespace",
              namespace, "--host", "127.0.0.1"]
    procs = [
        Proc([*common, "--engine", "mocker", "--model-name", "tiny", "--speedup-ratio", "1000"]),
        Proc([*common, "--engine", ECHO, "--model-name", "echo", "--echo-delay", "0.05",
              "--metrics-port", "0"]),
        Proc([*common, "--engine", SCORED, "--model-name", "scored"]),
        Proc([*common, "--engine", ECHO, "--model-name", "echo-error", "--echo-finish", "error"]),
        Proc(["-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace", namespace]),
    ]
    try:
        for proc in procs:
            proc.wait_ready(60)
        yield procs[1], procs[-1].address
    finally:
        for proc in procs:
            proc.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(stack):
    _, url = stack
    await wait_models(url, {"tiny", "echo", "scored", "echo-error"})
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as c:
        yield c


async def test_chat_n_gives_n_choices_streamed_and_not(client):
    resp = await client.chat.completions.create(
        model="tiny", messages=CHAT, n=3, max_tokens=8, seed=7, extra_body={"ignore_eos": True},
    )
    assert [c.index for c in resp.choices] == [0, 1, 2]
    texts = [c.message.content for c in resp.choices]
    assert all(texts) and len(set(texts)) == 3, texts  # seed + i: the choices differ
    assert all(c.finish_reason == "length" for c in resp.choices)
    single = await client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=8, seed=7, extra_body={"ignore_eos": True},
    )
    assert resp.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once
    assert resp.usage.completion_tokens == 3 * 8
    assert texts[0] == single.choices[0].message.content  # choice 0 uses the seed itself

    stream = await client.chat.completions.create(
        model="tiny", messages=CHAT, n=3, max_tokens=8, seed=7, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = [c async for c in stream]
    streamed: dict[int, str] = defaultdict(str)
    finishes: dict[int, list[str]] = defaultdict(list)
    roles = set()
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        if choice.delta.role:
            roles.add(choice.index)
        streamed[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
    assert roles == {0, 1, 2}
    assert dict(finishes) == {i: ["length"] for i in range(3)}
    assert [streamed[i] for i in range(3)] == texts  # same seeds, same choices
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 24
    assert usage.prompt_tokens == single.usage.prompt_tokens
    assert usage.total_tokens == usage.prompt_tokens + 24


async def test_completions_n_streams_interleaved_chunks_per_index(client):
    stream = await client.completions.create(
        model="echo", prompt="one two three four", n=3, max_tokens=4, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    texts: dict[int, str] = defaultdict(str)
    for chunk in chunks[:-1]:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    # The echo engine streams the prompt back: every choice is the same text.
    assert sorted(texts) == [0, 1, 2] and len(set(texts.values())) == 1
    order = [c.choices[0].index for c in chunks[:-1]]
    assert order != sorted(order)  # interleaved as they came, not one choice after another
    assert chunks[-1].usage.completion_tokens == 12
    resp = await client.completions.create(model="echo", prompt="one two", n=2, max_tokens=3)
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.usage.completion_tokens == 6
    # continuous_usage_stats: every chunk has the usage so far, over all choices
    stream = await client.completions.create(
        model="echo", prompt="one two", n=2, max_tokens=3, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    used = [c.usage.completion_tokens async for c in stream]
    assert used == sorted(used) and used[-1] == 6


async def test_every_choice_of_n_gets_its_own_logprobs(client):
    """Logprobs with ``n > 1``: each choice's follow its own tokens, streamed and not (chat),
    and in completions' legacy shape."""
    resp = await client.chat.completions.create(
        model="tiny", messages=CHAT, n=2, max_tokens=6, seed=3, logprobs=True, top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    for choice in resp.choices:
        content = choice.logprobs.content
        assert len(content) == 6
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    stream = await client.chat.completions.create(
        model="tiny", messages=CHAT, n=2, max_tokens=6, seed=3, logprobs=True, top_logprobs=2,
        stream=True, extra_body={"ignore_eos": True},
    )
    tokens: dict[int, list[str]] = defaultdict(list)
    async for chunk in stream:
        (choice,) = chunk.choices
        if choice.logprobs is not None:
            tokens[choice.index] += [t.token for t in choice.logprobs.content]
    assert dict(tokens) == {  # the same seeds: the same tokens, each in its own choice
        c.index: [t.token for t in c.logprobs.content] for c in resp.choices
    }
    done = await client.completions.create(
        model="tiny", prompt="The weather", n=2, max_tokens=5, logprobs=1, seed=3,
        extra_body={"ignore_eos": True},
    )
    for choice in done.choices:
        assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == 5


async def test_best_of_returns_the_highest_scoring_sequences(client):
    """Sequence ``j`` uses ``seed + j``; the scored engine gives each a known log-probability
    per token, so the best ``n`` of ``best_of`` are known; they come best first."""
    prompt = list(range(300, 308))  # eight token ids: the offset (seed % 8) tells them apart
    every = await client.completions.create(model="scored", prompt=prompt, n=5, max_tokens=4,
                                            seed=100)
    by_seed = {100 + c.index: c.text for c in every.choices}
    assert len(set(by_seed.values())) == 5
    best = await client.completions.create(model="scored", prompt=prompt, n=2, best_of=5,
                                           max_tokens=4, seed=100)
    ranked = sorted(by_seed, key=lambda s: -token_logprob(s))
    assert [c.text for c in best.choices] == [by_seed[s] for s in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1]
    assert best.usage.completion_tokens == 5 * 4  # every sequence generated is counted
    with pytest.raises(openai.BadRequestError) as exc:
        await client.completions.create(model="scored", prompt="x", n=1, best_of=2,
                                        stream=True)
    assert exc.value.body["param"] == "best_of"


async def test_what_an_engine_lacks_is_refused_naming_it(client):
    """``best_of`` needs log-probabilities and ``logit_bias`` an engine that honours it: the
    echo engine has neither (the mocker has both)."""
    cases = (("echo", "echo", {"best_of": 2}), ("echo", "echo", {"logit_bias": {"5": 100}}))
    for model, engine, extra in cases:
        with pytest.raises(openai.BadRequestError) as exc:
            await client.completions.create(model=model, prompt="x", max_tokens=2, **extra)
        assert exc.value.body["param"] == next(iter(extra)), exc.value.body
        assert f"the {engine} engine" in exc.value.body["message"], exc.value.body


async def test_prompt_logprobs_are_refused_naming_an_engine_without_them(client):
    """``prompt_logprobs`` and completions' ``echo`` with ``logprobs`` need an engine with
    ``Capability.PROMPT_LOGPROBS`` (vLLM: tests/test_vllm_logprobs.py); the mocker has none.
    As on vLLM's server, ``prompt_logprobs`` above 0 cannot be streamed, and at most 20."""
    for extra, param in (({"echo": True, "logprobs": 1}, "echo"),
                         ({"extra_body": {"prompt_logprobs": 2}}, "prompt_logprobs")):
        with pytest.raises(openai.BadRequestError) as exc:
            await client.completions.create(model="tiny", prompt="x", max_tokens=2, **extra)
        assert exc.value.body["param"] == param, exc.value.body
        assert "the mocker engine" in exc.value.body["message"], exc.value.body
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2,
                                             extra_body={"prompt_logprobs": 0})
    assert "the mocker engine" in exc.value.body["message"], exc.value.body
    for extra in ({"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": 21}):
        with pytest.raises(openai.BadRequestError) as exc:
            await client.completions.create(model="tiny", prompt="x", max_tokens=2,
                                            extra_body=extra)
        assert exc.value.body["param"] == "prompt_logprobs", exc.value.body


async def test_the_mocker_honours_logit_bias(client, tiny_model):
    """A bias of 100 forces a token; -100 on the mocker's own first token moves it off."""
    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    forced = await client.completions.create(
        model="tiny", prompt="The weather", max_tokens=5, logit_bias={"296": 100}, seed=1,
        n=2,
    )
    assert [c.text for c in forced.choices] == [tokenizer.decode([296] * 5)] * 2
    prompt = [300, 301, 302]
    first = mocker_tokens(tiny_model, prompt, 5, 1)[0]
    free = await client.completions.create(model="tiny", prompt=prompt, max_tokens=1, seed=5,
                                           extra_body={"ignore_eos": True})
    banned = await client.completions.create(model="tiny", prompt=prompt, max_tokens=1, seed=5,
                                             logit_bias={str(first): -100},
                                             extra_body={"ignore_eos": True})
    assert free.choices[0].text == tokenizer.decode([first])
    assert banned.choices[0].text != free.choices[0].text
    with pytest.raises(openai.BadRequestError) as exc:
        await client.completions.create(model="tiny", prompt="x", logit_bias={"100000": 1})
    assert exc.value.body["param"] == "logit_bias" and "vocabulary" in exc.value.body["message"]


async def test_echo_puts_the_prompt_before_each_choice(client, tiny_model):
    resp = await client.completions.create(model="tiny", prompt="Once upon a time", echo=True,
                                           max_tokens=4)
    assert resp.choices[0].text.startswith("Once upon a time")
    assert len(resp.choices[0].text) > len("Once upon a time")
    stream = await client.completions.create(model="tiny", prompt="Once upon a time", echo=True,
                                             max_tokens=4, n=2, stream=True)
    chunks = [c async for c in stream]
    firsts = {}
    for chunk in chunks:
        firsts.setdefault(chunk.choices[0].index, chunk.choices[0].text)
    assert firsts == {0: "Once upon a time", 1: "Once upon a time"}
    # A token prompt is echoed as its text.
    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    batch = [[300, 301, 302], [303]]
    ids = await client.completions.create(model="tiny", prompt=batch, echo=True, max_tokens=1)
    for choice, prompt in zip(ids.choices, batch, strict=True):
        echoed = tokenizer.decode(prompt, skip_special_tokens=True)
        assert echoed and choice.text.startswith(echoed), (choice.text, echoed)


async def test_a_batch_of_prompts_with_n_gets_openais_indexes(client):
    """Choice ``j`` of prompt ``p`` has index ``p * n + j``; usage sums the prompts."""
    prompts = ["alpha beta", "gamma delta epsilon"]
    resp = await client.completions.create(model="echo", prompt=prompts, n=2, max_tokens=3)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    singles = [await client.completions.create(model="echo", prompt=p, max_tokens=3)
               for p in prompts]
    assert [c.text for c in resp.choices] == [singles[0].choices[0].text] * 2 + [
        singles[1].choices[0].text] * 2
    assert resp.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert resp.usage.completion_tokens == 4 * 3
    stream = await client.completions.create(model="echo", prompt=prompts, n=2, max_tokens=3,
                                             stream=True)
    texts: dict[int, str] = defaultdict(str)
    async for chunk in stream:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert [texts[i] for i in range(4)] == [c.text for c in resp.choices]
    token_batch = await client.completions.create(model="echo", prompt=[[300, 301], [302]],
                                                  max_tokens=2)
    assert [c.index for c in token_batch.choices] == [0, 1]


def mocker_tokens(model_dir, prompt: list[int], seed: int, count: int) -> list[int]:
    """The tokens the mocker samples for ``prompt`` and ``seed`` (its own generator)."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(sequence_seed(seed, prompt))
    return [rng.randrange(vocab) for _ in range(count)]


async def test_mocker_observes_min_tokens_stop_token_ids_and_seed(client, tiny_model):
    prompt = [100, 101, 102, 103]
    base = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "seed": 3}
    eos = {"ignore_eos": True}
    first = await client.completions.create(**base, extra_body=eos)
    again = await client.completions.create(**base, extra_body=eos)
    other = await client.completions.create(**{**base, "seed": 4}, extra_body=eos)
    assert first.choices[0].text == again.choices[0].text != other.choices[0].text
    tokens = mocker_tokens(tiny_model, prompt, 3, 12)
    stop = tokens[3]
    assert stop not in tokens[:3]
    ended = await client.completions.create(**base, extra_body={**eos, "stop_token_ids": [stop]})
    assert (ended.choices[0].finish_reason, ended.choices[0].stop_reason) == ("stop", stop)
    assert ended.usage.completion_tokens == 4
    later = tokens.index(stop, 4) + 1 if stop in tokens[4:] else None
    held = await client.completions.create(
        **base, extra_body={**eos, "stop_token_ids": [stop], "min_tokens": 5}
    )
    assert held.usage.completion_tokens == (later or 12)  # not before min_tokens


async def test_disconnect_mid_stream_stops_every_sub_request(stack, client):
    """A client that goes away while three choices stream: the worker sees three
    cancellations and nothing is left in flight."""
    proc, url = stack
    await client.completions.create(model="echo", prompt="warm", max_tokens=1)
    host, port = re.match(r"http://([^:]+):(\d+)", url).groups()
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    body = json.dumps({"model": "echo", "prompt": "word " * 50, "max_tokens": 2000, "n": 3,
                       "stream": True})
    mport = system_port(proc)
    _, page = await asyncio.to_thread(get, f"http://127.0.0.1:{mport}/metrics")
    before = sample(page.decode(), "dynamo_component_cancellation_total", model="echo") or 0
    await asyncio.to_thread(conn.request, "POST", "/v1/completions", body,
                            {"Content-Type": "application/json"})
    resp = await asyncio.to_thread(conn.getresponse)
    assert resp.status == 200
    seen: set[bytes] = set()
    while len(seen) < 3:  # every choice has streamed
        line = await asyncio.to_thread(resp.readline)
        match = re.search(rb'"index":(\d+),"text":"[^"]', line)
        if match:
            seen.add(match.group(1))
    conn.sock.close()
    conn.close()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 15
    while True:
        _, metrics = await asyncio.to_thread(get, f"http://127.0.0.1:{mport}/metrics")
        page = metrics.decode()
        if (sample(page, "dynamo_component_cancellation_total", model="echo") == before + 3
                and sample(page, "dynamo_component_inflight_requests", model="echo") == 0):
            break
        assert loop.time() < deadline, "the worker never saw the three cancellations"
        await asyncio.sleep(0.1)


async def test_a_failing_sub_request_fails_the_response(client):
    """Every choice of 'echo-error' ends with an engine error: the response is the error the
    single-choice path gives (500 / an SSE error event), never a partial success."""
    with pytest.raises(openai.InternalServerError) as exc:
        await client.completions.create(model="echo-error", prompt="a b", n=2, max_tokens=3)
    assert "fails on purpose" in str(exc.value)
    with pytest.raises(openai.APIError) as err:
        stream = await client.chat.completions.create(
            model="echo-error", messages=CHAT, n=2, max_tokens=3, stream=True
        )
        async for _ in stream:
            pass
    assert err.value.body["type"] == "server_error" and "fails on purpose" in str(err.value)


async def test_the_deadline_ends_every_choice_with_504(client):
    with pytest.raises(openai.APIStatusError) as exc:
        await client.completions.create(
            model="echo", prompt="word " * 50, max_tokens=2000, n=3,
            extra_headers={"x-dynamo-request-timeout": "1"},
        )
    assert exc.value.status_code == 504


async def test_each_sub_request_migrates_on_its_own(namespace, spawn, tiny_model):
    """``n=2`` over two workers (round-robin: one choice each), one of which ends its streams
    with ``EngineShutdown`` after 10 tokens: that choice goes on from the other worker, and both
    are the text the request gets fault-free."""
    f = await fleet(spawn, namespace, tiny_model, 1)
    url = f.url
    params = {"model": "tiny", "messages": CHAT, "n": 2, "seed": 11, "max_tokens": 40,
              "extra_body": {"ignore_eos": True}}
    async with client_for(url) as c:
        ref = await c.chat.completions.create(**params)
        ending = mocker(spawn, namespace, tiny_model, "--engine",
                        "tests.support.engines:ShuttingDownMocker", "--shutdown-after", "10")
        await serving(f.front, [*f.workers, ending])
        raw = await c.chat.completions.with_raw_response.create(**params)
        resp = raw.parse()
    assert len(raw.headers["x-dynamo-worker"].split(",")) == 2  # one choice on each worker
    assert [ch.message.content for ch in resp.choices] == [
        ch.message.content for ch in ref.choices
    ]
    assert resp.usage.completion_tokens == 80
    assert sample(await metrics_page(url), "dynamo_frontend_migrations_total",
                  reason="EngineShutdown") == 1
