"""Finish reasons as the request-flow document maps them: EoS, length, stop, cancelled, error.

The worker's post-processing (the document's decoder) tells an end-of-sequence token (``eos``)
from a stop token or stop string (``stop`` with ``stop_reason``); the frontend turns each into
OpenAI's ``finish_reason`` as Dynamo's OpenAI layer does (eos, stop, cancelled -> "stop";
length -> "length"; error -> an error, not a finish), with vLLM's ``stop_reason`` beside it.
"""

from __future__ import annotations

import json

import openai
import pytest
from tokenizers import Tokenizer

from dynamo_zmq.frontend.preprocess import Preprocessor
from dynamo_zmq.frontend.protocol import parse_chat
from dynamo_zmq.frontend.responses import OPENAI_FINISH_REASONS, openai_finish_reason
from dynamo_zmq.llm import (
    FinishReason,
    LLMEngineOutput,
    PostProcessor,
    PreprocessedRequest,
    StopConditions,
    build_card,
)
from dynamo_zmq.tools.tiny_model import EOS
from tests.support.mocker_fleet import ECHO, start_frontend, start_worker
from tests.support.waiting import wait_models


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


@pytest.fixture(scope="module")
def eos_id(tokenizer) -> int:
    eos = tokenizer.token_to_id(EOS)
    assert eos is not None
    return eos


# -- the mappings, as tables -------------------------------------------------------------------


@pytest.mark.parametrize(("ours", "openai_reason"), [
    ("eos", "stop"),
    ("stop", "stop"),
    ("length", "length"),
    ("cancelled", "stop"),  # Dynamo: FinishReason::Cancelled -> FinishReason::Stop
    ("tool_calls", "tool_calls"),  # issue 15: the worker parsed a tool call
    ("something-new", "stop"),
])
def test_openai_finish_reason_table(ours, openai_reason):
    assert openai_finish_reason(ours) == openai_reason


def test_error_is_not_a_finish_reason():
    """An error ends a request as an OpenAI error (500 / an SSE error event), as in Dynamo's
    chat delta generator, never as a finish_reason."""
    assert FinishReason.ERROR not in OPENAI_FINISH_REASONS
    assert set(OPENAI_FINISH_REASONS) == (
        (FinishReason.ALL - {FinishReason.ERROR}) | {"eos", "tool_calls"}
    )


def _terminal(tokenizer, prompt, chunk, **stop) -> LLMEngineOutput:
    req = PreprocessedRequest(prompt, stop=StopConditions(**stop), eos_token_ids=[2])
    proc = PostProcessor(req, tokenizer)
    out = proc.process(chunk)
    assert out.is_terminal
    return out


@pytest.mark.parametrize(("chunk", "stop", "finish", "stop_reason"), [
    # the engine's "stop" on the end-of-sequence token: EoS
    (LLMEngineOutput([7, 2], finish_reason="stop"), {}, "eos", None),
    # ... on a stop token the request named: stop, with the token
    (LLMEngineOutput([7, 9], finish_reason="stop"), {"stop_token_ids": [9]}, "stop", 9),
    # a stop token that is also the EOS token: the request named it, so it is the stop token
    (LLMEngineOutput([2], finish_reason="stop"), {"stop_token_ids": [2]}, "stop", 2),
    # the engine said why (vLLM's stop_reason): a stop string or token is kept ...
    (LLMEngineOutput([7], finish_reason="stop", stop_reason="ab"), {}, "stop", "ab"),
    (LLMEngineOutput([7], finish_reason="stop", stop_reason=11), {}, "stop", 11),
    (LLMEngineOutput([9], finish_reason="stop", stop_reason=9), {"stop_token_ids": [9]},
     "stop", 9),
    # ... but an end-of-sequence id it names (it got them as stop tokens) is EoS
    (LLMEngineOutput([7, 2], finish_reason="stop", stop_reason=2), {}, "eos", None),
    # the engine said stop and nothing tells why: stop
    (LLMEngineOutput([7], finish_reason="stop"), {}, "stop", None),
    (LLMEngineOutput(finish_reason="stop"), {}, "stop", None),
    (LLMEngineOutput([7, 2], finish_reason="length"), {}, "length", None),
    (LLMEngineOutput(finish_reason="cancelled"), {}, "cancelled", None),
    (LLMEngineOutput(finish_reason="error", error="boom"), {}, "error", None),
    # engines' own names
    (LLMEngineOutput(finish_reason="eos"), {}, "eos", None),
    (LLMEngineOutput(finish_reason="abort"), {}, "cancelled", None),
])
def test_worker_finish_table(tokenizer, chunk, stop, finish, stop_reason):
    out = _terminal(tokenizer, [5, 6], chunk, **stop)
    assert (out.finish_reason, out.stop_reason) == (finish, stop_reason)


def test_a_stop_string_is_the_stop_reason(tokenizer):
    ids = tokenizer.encode("one two STOP three", add_special_tokens=False).ids
    req = PreprocessedRequest([5], stop=StopConditions(stop=["zz", " STOP"]), eos_token_ids=[2])
    proc = PostProcessor(req, tokenizer)
    outs = [proc.process(LLMEngineOutput([t])) for t in ids]
    last = next(o for o in outs if o.is_terminal)
    assert (last.finish_reason, last.stop_reason) == ("stop", " STOP")


# -- through a real worker, on the runtime API ---------------------------------------------------


async def test_the_worker_tells_eos_from_stop_tokens_and_strings(
    namespace, spawn, make_runtime, tiny_model, tokenizer, eos_id
):
    proc = spawn("-m", "dynamo_zmq.worker", "--model-path", str(tiny_model),
                 "--namespace", namespace, "--host", "127.0.0.1", "--grace-period", "0",
                 "--engine", ECHO, "--echo-finish", "stop")
    client = await (
        make_runtime(static=(proc.address,)).endpoint(f"{namespace}.backend.generate").client()
    )
    await client.wait_for_instances(timeout=15)
    words = tokenizer.encode("hello world again", add_special_tokens=False).ids

    async def terminal(ids, **stop):
        req = {"token_ids": ids, "eos_token_ids": [eos_id],
               "stop": {"max_tokens": len(ids), **stop}}
        chunks = [r.data() async for r in await client.generate(req)]
        return chunks[-1].get("finish_reason"), chunks[-1].get("stop_reason")

    assert await terminal([*words, eos_id]) == ("eos", None)
    assert await terminal(words, stop_token_ids=[words[-1]]) == ("stop", words[-1])
    assert await terminal(words, stop=["world"]) == ("stop", "world")


# -- through HTTP with the real openai client ----------------------------------------------------


async def finish_of(client, kind: str, stream: bool, **kwargs) -> tuple[str, object]:
    """(finish_reason, stop_reason) of one request, as the openai client reads them."""
    if kind == "chat":
        create = client.chat.completions.create
        kwargs["messages"] = [{"role": "user", "content": kwargs.pop("prompt")}]
    else:
        create = client.completions.create
    if not stream:
        choice = (await create(stream=False, **kwargs)).choices[0]
        return choice.finish_reason, (choice.model_extra or {}).get("stop_reason")
    finishes = [
        (c.choices[0].finish_reason, (c.choices[0].model_extra or {}).get("stop_reason"))
        async for c in await create(stream=True, **kwargs)
        if c.choices and c.choices[0].finish_reason
    ]
    assert len(finishes) == 1, finishes
    return finishes[0]


async def test_finish_reasons_over_http(namespace, spawn, tiny_model, tokenizer, eos_id):
    """Echo workers ending with each engine finish reason (model ``echo-REASON``) behind one
    frontend; chat and completions, streaming and not."""
    reasons = ("length", "stop", "cancelled", "error")
    for reason in reasons:
        start_worker(spawn, namespace, tiny_model, "--echo-finish", reason,
                     model=f"echo-{reason}", engine=ECHO, ready=True)
    url = start_frontend(spawn, namespace, mode=None, ready=True).address
    await wait_models(url, {f"echo-{r}" for r in reasons})
    text = "hello world again"
    # The chat prompt the echo engine streams back is the rendered template: ending the echo on
    # its first end-of-sequence token (after the user's turn) needs that token's position.
    chat_ids = Preprocessor(tiny_model, build_card(tiny_model, "m")).chat(parse_chat(
        json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()
    )).token_ids
    completion_ids = [*tokenizer.encode(text, add_special_tokens=False).ids, eos_id]
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
        for kind in ("chat", "completions"):
            ids = chat_ids if kind == "chat" else completion_ids
            prompt: str | list[int] = text if kind == "chat" else completion_ids
            for stream in (False, True):
                await _check_finishes(client, kind, stream, prompt, ids, eos_id)


async def _check_finishes(client, kind, stream, prompt, ids, eos_id) -> None:
    async def finish(model: str, **kwargs):
        return await finish_of(client, kind, stream, model=f"echo-{model}", prompt=prompt,
                               **kwargs)

    case = (kind, stream)
    assert await finish("length", max_tokens=3) == ("length", None), case
    # EoS: the echo ends on the end-of-sequence token
    assert await finish("stop", max_tokens=ids.index(eos_id) + 1) == ("stop", None), case
    # a stop token the request named
    stop_token = ids[1]
    assert await finish("stop", max_tokens=2, extra_body={"stop_token_ids": [stop_token]}) == (
        "stop", stop_token
    ), case
    # a stop string (matched by the worker)
    assert await finish("length", max_tokens=len(ids), stop=["world"]) == ("stop", "world"), case
    # cancelled by the engine while the client is still there: "stop", as in Dynamo
    assert await finish("cancelled", max_tokens=3) == ("stop", None), case
    # error: an OpenAI error, not a finish reason
    if stream:
        with pytest.raises(openai.APIError) as exc:
            await finish("error", max_tokens=3)
        assert exc.value.body["type"] == "server_error", case
    else:
        with pytest.raises(openai.InternalServerError) as exc:
            await finish("error", max_tokens=3)
    assert "fails on purpose" in str(exc.value), case


async def test_mocker_ends_on_eos_unless_ignored(namespace, spawn, tiny_model):
    """The mocker samples the end-of-sequence token like any other (1 in 512 per token here):
    with ignore_eos off a long request ends on it, as "stop" without a stop_reason."""
    start_worker(spawn, namespace, tiny_model, ready=True)
    url = start_frontend(spawn, namespace, mode=None, ready=True).address
    await wait_models(url, {"tiny"})
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
        ended = None
        for seed in range(30):  # each seed is deterministic; most end on EoS within 600 tokens
            resp = await client.completions.create(
                model="tiny", prompt="Once upon a time", max_tokens=600, seed=seed
            )
            if resp.choices[0].finish_reason == "stop":
                ended = seed, resp
                break
            assert resp.choices[0].finish_reason == "length"
        assert ended is not None, "no seed in 30 ended on the end-of-sequence token"
        seed, resp = ended
        assert resp.usage.completion_tokens < 600
        extra = resp.choices[0].model_extra or {}
        assert "stop_reason" in extra and extra["stop_reason"] is None  # vLLM's field, null
        ignored = await client.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=600, seed=seed,
            extra_body={"ignore_eos": True},
        )
        assert ignored.choices[0].finish_reason == "length"
        assert ignored.usage.completion_tokens == 600
