"""Logprobs through the real frontend and worker processes with the `openai` client: the
mocker's values are well-formed (chat and completions, streaming and not), they stay aligned
with the tokens a stop string lets through, an engine without logprobs (the echo test engine)
is refused with a 400 naming it, and out-of-range values are 400s naming the parameter."""

from __future__ import annotations

import math
import time
import uuid

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.procs import Proc

ECHO = "tests.support.engines:EchoEngine"
MESSAGES = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture(scope="module")
def client(tiny_model):
    """A mocker worker serving 'tiny', an echo worker serving 'plain', one frontend."""
    namespace = f"t{uuid.uuid4().hex[:12]}"
    procs: list[Proc] = []
    common = ["--model-path", str(tiny_model), "--namespace", namespace, "--host", "127.0.0.1"]
    try:
        procs.append(Proc(["-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-name",
                           "tiny", "--speedup-ratio", "1000", *common]))
        procs.append(Proc(["-m", "dynamo_zmq.worker", "--engine", ECHO, "--model-name",
                           "plain", *common]))
        front = Proc(["-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace", namespace])
        procs.append(front)
        for proc in procs:
            proc.wait_ready()
        with openai.OpenAI(base_url=f"{front.address}/v1", api_key="none",
                           max_retries=0) as c:
            deadline = time.monotonic() + 30
            while {m.id for m in c.models.list().data} != {"tiny", "plain"}:
                assert time.monotonic() < deadline, "models never listed"
                time.sleep(0.1)
            yield c
    finally:
        for proc in procs:
            proc.stop()


def check_chat_entries(content, k: int) -> None:
    """Well-formed chat logprobs: finite, <= 0, bytes of the token, k alternatives sorted
    descending with the sampled token among them, its value the same there."""
    for entry in content:
        assert math.isfinite(entry.logprob) and entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode("utf-8", errors="replace"))
        top = entry.top_logprobs
        assert len(top) == k
        values = [t.logprob for t in top]
        assert values == sorted(values, reverse=True)
        assert all(math.isfinite(v) and v <= 0 for v in values)
        assert all(t.bytes == list(t.token.encode("utf-8", errors="replace")) for t in top)
        if k:
            assert top[0].token == entry.token and top[0].logprob == entry.logprob
        assert sum(math.exp(v) for v in values) <= 1 + 1e-9


def test_chat_mocker_unary_and_streaming_agree(client):
    resp = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=9, logprobs=True, top_logprobs=3
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 9
    check_chat_entries(content, 3)
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=9, logprobs=True, top_logprobs=3,
        stream=True,
    )
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    # logprobs alone: the sampled token's, no alternatives
    resp = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, logprobs=True
    )
    check_chat_entries(resp.choices[0].logprobs.content, 0)
    assert len(resp.choices[0].logprobs.content) == 4
    # not asked for: none
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
    assert resp.choices[0].logprobs is None


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(k=st.integers(0, 20), prompt=st.text(min_size=1, max_size=40), stream=st.booleans())
def test_chat_mocker_logprobs_are_well_formed(client, k, prompt, stream):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=6,
                  logprobs=True, top_logprobs=k)
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        content = [e for c in chunks if c.choices and c.choices[0].logprobs
                   for e in c.choices[0].logprobs.content]
        usage = None
    else:
        resp = client.chat.completions.create(**kwargs)
        content, usage = resp.choices[0].logprobs.content, resp.usage.completion_tokens
    assert len(content) == (usage if usage is not None else len(content)) and 1 <= len(content)
    assert len(content) <= 6
    check_chat_entries(content, k)


@pytest.mark.parametrize("k", [0, 2, 5])
def test_completions_mocker_legacy_shape(client, k):
    resp = client.completions.create(model="tiny", prompt="Once upon", max_tokens=7, logprobs=k)
    lp = resp.choices[0].logprobs
    n = resp.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert math.isfinite(value) and value <= 0
        # keyed by text (OpenAI's shape): two tokens with one text keep the later's value
        assert token in top and max(top.values()) <= value and 1 <= len(top) <= max(k, 1)
        assert all(math.isfinite(v) and v <= 0 for v in top.values())
    stream = client.completions.create(model="tiny", prompt="Once upon", max_tokens=7,
                                       logprobs=k, stream=True)
    parts = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [v for p in parts for v in p.token_logprobs] == lp.token_logprobs
    assert [o for p in parts for o in p.text_offset] == lp.text_offset
    assert [t for p in parts for t in p.top_logprobs] == lp.top_logprobs


def test_stop_string_keeps_logprobs_aligned(client):
    """A stop string cuts the text: the logprobs list exactly the tokens that reached the
    client (the usage counts them too)."""
    full = client.completions.create(model="tiny", prompt="abc", max_tokens=12, logprobs=1)
    tokens = full.choices[0].logprobs.tokens
    at, stop = next((i, t.strip()) for i, t in enumerate(tokens) if i >= 3
                    and t.strip().isascii() and t.strip().isalnum())
    cut = client.completions.create(model="tiny", prompt="abc", max_tokens=12, logprobs=1,
                                    stop=[stop])
    lp = cut.choices[0].logprobs
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].stop_reason == stop
    assert len(lp.tokens) == cut.usage.completion_tokens <= at + 1
    assert lp.tokens == tokens[: len(lp.tokens)]
    assert lp.token_logprobs == full.choices[0].logprobs.token_logprobs[: len(lp.tokens)]
    assert stop not in cut.choices[0].text


def test_engine_without_logprobs_is_refused(client):
    for call in (
        lambda: client.chat.completions.create(model="plain", messages=MESSAGES, max_tokens=2,
                                               logprobs=True),
        lambda: client.completions.create(model="plain", prompt="x", max_tokens=2, logprobs=0),
    ):
        with pytest.raises(openai.BadRequestError) as exc:
            call()
        body = exc.value.body
        assert body["param"] == "logprobs" and "echo engine" in body["message"]
    # the same engine serves requests without logprobs
    assert client.completions.create(model="plain", prompt="x", max_tokens=2).choices


@pytest.mark.parametrize(("endpoint", "extra", "param"), [
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("completions", {"logprobs": 6}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
])
def test_out_of_range_is_400(client, endpoint, extra, param):
    with pytest.raises(openai.BadRequestError) as exc:
        if endpoint == "chat":
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                           **extra)
        else:
            client.completions.create(model="tiny", prompt="x", max_tokens=2, **extra)
    assert exc.value.body["param"] == param
