"""Multi-token SSE events (issue 34): tokens that reach the frontend together go out as one
event, and a stream so written says exactly what the one-token-per-event stream says.

Three mocker workers serve the same tokens (same model files, same seed) at three speeds: 'fast'
(speedup 1e6: a whole answer in a few steps), 'paced' (speedup 1: a token every ~6 ms) and
'slow' (speedup 0.02: a token every ~0.3 s). A client reading 'fast' slowly, through a small
receive buffer, makes the frontend wait on its writes while tokens pile up: it reads fewer,
larger events. Their concatenated text, logprobs, usage and finish reason equal 'paced''s,
read promptly, and the unary answer's. 'slow''s tokens, read promptly, come one per event: the
first token is never held back for company.
"""

from __future__ import annotations

import asyncio
import json
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio

from tests.support.procs import Proc
from tests.support.waiting import wait_models

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]

SPEEDS = {"fast": "1000000", "paced": "1", "slow": "0.02"}
CHAT = [{"role": "user", "content": "Tell me a long story about a dragon."}]


@pytest.fixture(scope="module")
def stack(tiny_model) -> Iterator[str]:
    """The three mocker workers and a frontend; yields the frontend's URL."""
    namespace = f"t{uuid.uuid4().hex[:12]}"
    common = ["-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path", str(tiny_model),
              "--namespace", namespace, "--host", "127.0.0.1"]
    procs = [Proc([*common, "--model-name", name, "--speedup-ratio", speed])
             for name, speed in SPEEDS.items()]
    procs.append(Proc(["-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace",
                       namespace]))
    try:
        for proc in procs:
            proc.wait_ready(60)
        yield procs[-1].address
    finally:
        for proc in procs:
            proc.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def url(stack: str) -> str:
    await wait_models(stack, set(SPEEDS))
    return stack


def body(model: str, endpoint: str, stream: bool, max_tokens: int) -> dict[str, Any]:
    req: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "seed": 11,
                           "ignore_eos": True, "stream": stream}
    if endpoint == "chat":
        req.update(messages=CHAT, logprobs=True, top_logprobs=3)
    else:
        req.update(prompt="Tell me a long story about a dragon.", logprobs=3)
    if stream:
        req["stream_options"] = {"include_usage": True}
    return req


async def read_events(url: str, req: dict[str, Any], endpoint: str,
                      small_buffer: bool) -> list[dict[str, Any]]:
    """The stream's events, in order (``[DONE]`` left out). ``small_buffer``: through a 4 KiB
    receive buffer, starting to read only a second after the response began."""
    options = [(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)] if small_buffer else None
    transport = httpx.AsyncHTTPTransport(socket_options=options)
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    events: list[dict[str, Any]] = []
    async with httpx.AsyncClient(transport=transport, timeout=60) as client:
        async with client.stream("POST", url + path, json=req) as resp:
            assert resp.status_code == 200
            if small_buffer:
                await asyncio.sleep(1.0)  # let the frontend's writes back up
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
    return events


def tokens_of(event: dict[str, Any], endpoint: str) -> int:
    """How many tokens a content event carries (its logprobs list one per token)."""
    lp = event["choices"][0]["logprobs"] if event["choices"] else None
    if not lp:
        return 0
    return len(lp["content"] if endpoint == "chat" else lp["tokens"])


def gathered(events: list[dict[str, Any]], endpoint: str) -> dict[str, Any]:
    """What a stream says in all: text, logprobs (joined), finish reason and usage."""
    text, finish, usage = "", None, None
    logprobs: dict[str, list[Any]] = {}
    for event in events:
        if event.get("usage"):
            usage = event["usage"]
        for choice in event["choices"]:
            if endpoint == "chat":
                text += choice["delta"].get("content") or ""
            else:
                text += choice["text"]
            for key, values in (choice["logprobs"] or {}).items():
                logprobs.setdefault(key, []).extend(values)
            finish = choice["finish_reason"] or finish
    return {"text": text, "logprobs": logprobs, "finish": finish, "usage": usage}


def unary(resp: dict[str, Any], endpoint: str) -> dict[str, Any]:
    choice = resp["choices"][0]
    text = choice["message"]["content"] if endpoint == "chat" else choice["text"]
    return {"text": text, "logprobs": choice["logprobs"], "finish": choice["finish_reason"],
            "usage": resp["usage"]}


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_tokens_that_arrive_together_go_out_as_one_event_saying_the_same(url, endpoint):
    n = 400  # ~0.3 MB of events with logprobs: more than the socket buffers hold
    merged = await read_events(url, body("fast", endpoint, True, n), endpoint, small_buffer=True)
    one_by_one = await read_events(url, body("paced", endpoint, True, n), endpoint,
                                   small_buffer=False)
    async with httpx.AsyncClient(timeout=60) as client:
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        whole = (await client.post(url + path, json=body("fast", endpoint, False, n))).json()
    counts = [tokens_of(e, endpoint) for e in merged]
    assert sum(counts) == n
    assert max(counts) > 1 and len([c for c in counts if c]) < n, counts  # several per event
    said = gathered(merged, endpoint)
    assert said["finish"] == "length" and said["usage"]["completion_tokens"] == n
    assert said == gathered(one_by_one, endpoint)
    expected = unary(whole, endpoint)
    if endpoint == "chat":  # chat's unary logprobs are a dict with its content list
        expected["logprobs"] = {"content": expected["logprobs"]["content"]}
    assert said == expected


async def test_the_first_token_is_never_held_back(url):
    """With tokens ~0.3 s apart and a client that keeps up, each event carries one token: the
    first goes out alone, before the second exists."""
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as c:
        stream = await c.chat.completions.create(
            model="slow", messages=CHAT, max_tokens=3, seed=11, logprobs=True, stream=True,
            extra_body={"ignore_eos": True},
        )
        per_event = [len(e.choices[0].logprobs.content) async for e in stream
                     if e.choices and e.choices[0].logprobs]
    assert per_event == [1, 1, 1]
