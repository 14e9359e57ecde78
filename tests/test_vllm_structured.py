"""Structured outputs with the vLLM engine, through a real frontend and one vLLM worker process
on the random-weight tiny model, driven by the `openai` client: ``response_format``
json_schema / json_object, ``guided_choice``, ``guided_regex`` and ``guided_grammar`` give
answers that validate (streaming and not, chat and completions); what vLLM cannot compile is a
400 (an SSE error event when streaming) and the worker goes on serving; the worker's default
detokenization and vLLM's own (``output.detokenize``, as native processing asks) both hold the
constraint.

Runs only where vLLM is installed (skipped otherwise, failed in CI: see tests/test_vllm.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

import tests.support.needs_vllm  # noqa: F401  (skips this module without vLLM; fails it in CI)

# isort: split

import jsonschema
import openai
import pytest_asyncio

from dynamo_zmq.frontend.protocol import parse_chat
from tests.conftest import runtime_factory
from tests.support.vllm_stack import wait_models

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

#: Every value bounded (enum, integer range, string length, boolean), so that even random
#: weights finish the object well within MAX_TOKENS.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "count", "name", "ok"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {"type": "json_schema",
                      "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
CHOICES = ["alpha", "beta", "gamma delta"]
REGEX = r"[a-c]{3}-[0-9]{2}"
MAX_TOKENS = 200
MESSAGES = [{"role": "user", "content": "Describe a thing as JSON."}]


@pytest.fixture(scope="module")
def stack(tiny_vllm_stack):
    """One vLLM worker (the default processing) and a frontend on its namespace (the
    session's shared pair)."""
    s = tiny_vllm_stack
    return s.namespace, s.worker, s.url


@pytest_asyncio.fixture(loop_scope="module")
async def client(stack):
    _, _, url = stack
    await wait_models(url)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as c:
        yield c


async def chat(client, stream: bool, **fields: Any) -> tuple[str, str]:
    """The answer's text and finish reason, from a chat request (streamed or not)."""
    kw = {"model": "tiny", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0}
    if not stream:
        resp = await client.chat.completions.create(**kw, **fields)
        return resp.choices[0].message.content, resp.choices[0].finish_reason
    text, reason = "", None
    async for chunk in await client.chat.completions.create(**kw, stream=True, **fields):
        for c in chunk.choices:
            text += c.delta.content or ""
            reason = c.finish_reason or reason
    return text, reason


async def complete(client, stream: bool, **fields: Any) -> tuple[str, str]:
    kw = {"model": "tiny", "prompt": "The answer is", "max_tokens": MAX_TOKENS, "temperature": 0}
    if "response_format" in fields:  # not a parameter of the client's completions
        fields["extra_body"] = {"response_format": fields.pop("response_format")}
    if not stream:
        resp = await client.completions.create(**kw, **fields)
        return resp.choices[0].text, resp.choices[0].finish_reason
    text, reason = "", None
    async for chunk in await client.completions.create(**kw, stream=True, **fields):
        for c in chunk.choices:
            text += c.text or ""
            reason = c.finish_reason or reason
    return text, reason


@pytest.mark.parametrize("stream", [False, True])
async def test_json_schema_answers_validate(client, stream):
    for call in (chat, complete):
        text, reason = await call(client, stream, response_format=JSON_SCHEMA_FORMAT)
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
        # vLLM's own name for it, with the schema as a JSON string.
        text, reason = await call(client, stream, extra_body={"guided_json": json.dumps(SCHEMA)})
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
async def test_json_object_choice_regex_and_grammar(client, stream):
    for call in (chat, complete):
        text, reason = await call(client, stream, response_format={"type": "json_object"})
        assert reason == "stop" and isinstance(json.loads(text), dict), text
        text, reason = await call(client, stream, extra_body={"guided_choice": CHOICES})
        assert reason == "stop" and text in CHOICES, text
        text, reason = await call(client, stream, extra_body={"guided_regex": REGEX})
        assert reason == "stop" and re.fullmatch(REGEX, text), text
        text, reason = await call(
            client, stream, extra_body={"guided_grammar": 'root ::= "yes" | "no" | "maybe"'}
        )
        assert reason == "stop" and text in ("yes", "no", "maybe"), text
        text, reason = await call(client, stream,
                                  extra_body={"structured_outputs": {"choice": CHOICES}})
        assert reason == "stop" and text in CHOICES, text


async def test_what_vllm_cannot_compile_is_400_and_the_worker_keeps_serving(client):
    bad = [
        {"guided_regex": "(unclosed"},
        {"guided_json": {"type": "nonsense"}},
        {"response_format": {"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": 7}}}},
        {"guided_grammar": "root ::= ("},
    ]
    for fields in bad:
        with pytest.raises(openai.BadRequestError) as info:
            await chat(client, False, extra_body=fields)
        assert info.value.body["code"] == "invalid_argument", info.value.body
        # Streaming: the response has started before the worker's answer, so the same error
        # comes as the stream's SSE error event (as every error from a worker does).
        with pytest.raises(openai.APIError) as info:
            await chat(client, True, extra_body=fields)
        assert info.value.body["code"] == "invalid_argument", info.value.body
        assert info.value.body["type"] == "invalid_request_error"
    text, reason = await chat(client, False, extra_body={"guided_choice": CHOICES})
    assert reason == "stop" and text in CHOICES
    resp = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5)
    assert resp.choices[0].finish_reason == "length"


async def test_the_engines_own_detokenization_holds_the_constraint(stack, tiny_model):
    """``output.detokenize`` (what native processing asks): vLLM makes the text, and it is
    still one of the choices / a match / valid JSON, as on the default path."""
    from dynamo_zmq.frontend.preprocess import Preprocessor
    from dynamo_zmq.llm import build_card

    namespace, worker, _ = stack
    pre = Preprocessor(tiny_model, build_card(tiny_model, "tiny"))
    cases = [
        ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
        ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
        ({"response_format": JSON_SCHEMA_FORMAT},
         lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ]
    async with runtime_factory() as make:
        rt = make(static=(worker.address,))
        gen = await rt.endpoint(f"{namespace}.backend.generate").client()
        await gen.wait_for_instances(timeout=15)
        for fields, valid in cases:
            body = {"model": "tiny", "messages": MESSAGES, "max_tokens": MAX_TOKENS,
                    "temperature": 0, **fields}
            request = pre.chat(parse_chat(json.dumps(body).encode()))
            request.output.detokenize = True
            chunks = [r.data() async for r in await gen.generate(request)]
            text = "".join(c.get("text") or "" for c in chunks)
            assert chunks[-1]["finish_reason"] in ("eos", "stop"), chunks[-1]
            assert valid(text), (fields, text)
