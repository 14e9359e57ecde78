"""Structured outputs on the frontend (dynamo_zmq/frontend/_structured.py): ``response_format``
and vLLM's ``guided_*`` / ``structured_outputs`` become ``PreprocessedRequest.guided``; malformed
constraints are 400s naming the parameter before any worker is asked; an engine without
``Capability.STRUCTURED_OUTPUTS`` (the mocker) gets a 400 naming the engine and the parameter.
The vLLM engine's side: tests/test_vllm_structured.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from dynamo_zmq.frontend.errors import HttpError
from dynamo_zmq.frontend.preprocess import Preprocessor
from dynamo_zmq.frontend.protocol import parse_chat, parse_completion
from dynamo_zmq.llm import Capability, GuidedDecoding, build_card
from tests.support.mocker_fleet import start_frontend, start_worker
from tests.support.waiting import wait_models

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "hi"}]

#: Each constraint kind as a client sends it, the parameter it is named by, and what it becomes.
CONSTRAINTS: list[tuple[dict[str, Any], str, GuidedDecoding]] = [
    ({"response_format": {"type": "json_object"}}, "response_format",
     GuidedDecoding(json_object=True)),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}},
     "response_format", GuidedDecoding(json_schema=SCHEMA)),
    ({"guided_json": SCHEMA}, "guided_json", GuidedDecoding(json_schema=SCHEMA)),
    ({"guided_json": json.dumps(SCHEMA)}, "guided_json", GuidedDecoding(json_schema=SCHEMA)),
    ({"guided_regex": "[ab]+"}, "guided_regex", GuidedDecoding(regex="[ab]+")),
    ({"guided_choice": ["x", "y"]}, "guided_choice", GuidedDecoding(choice=["x", "y"])),
    ({"guided_grammar": 'root ::= "x"'}, "guided_grammar",
     GuidedDecoding(grammar='root ::= "x"')),
    ({"structured_outputs": {"choice": ["x"]}}, "structured_outputs",
     GuidedDecoding(choice=["x"])),
    ({"structured_outputs": {"json": SCHEMA}}, "structured_outputs",
     GuidedDecoding(json_schema=SCHEMA)),
]

#: Malformed constraints and the parameter their 400 names.
MALFORMED: list[tuple[dict[str, Any], str]] = [
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": 3}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 1]}, "guided_choice"),
    ({"guided_choice": "a"}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": [1]}, "guided_json"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_grammar": 5}, "guided_grammar"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "t", "schema": SCHEMA, "strict": "yes"}}},
     "response_format.json_schema.strict"),
]


def strict_format(schema: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "t", "schema": schema, "strict": True}}}


OPEN = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
#: Schemas OpenAI's strict mode does not accept, and what the 400 says about each.
NOT_STRICT: list[tuple[dict[str, Any], str]] = [
    (OPEN, "'additionalProperties': false at '$'"),
    ({**SCHEMA, "required": []}, "missing: 'a'"),
    ({"type": "array", "items": SCHEMA}, "root must be 'type': 'object'"),
    ({"anyOf": [SCHEMA]}, "not 'anyOf'"),
    ({**SCHEMA, "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}},
                                     "required": ["b"]}}},
     "at '$.properties.a'"),
    ({**SCHEMA, "properties": {"a": {"type": "array", "items": OPEN}}},
     "at '$.properties.a.items'"),
    ({**SCHEMA, "properties": {"a": {"allOf": [{"type": "integer"}]}}},
     "'allOf' is not supported at '$.properties.a'"),
    ({**SCHEMA, "$defs": {"d": OPEN}}, "at '$.$defs.d'"),
]
MALFORMED += [(strict_format(schema), "response_format.json_schema.schema")
              for schema, _ in NOT_STRICT]


@pytest.mark.parametrize(("schema", "says"), NOT_STRICT)
def test_strict_refuses_what_strict_mode_does_not_accept(schema, says) -> None:
    with pytest.raises(HttpError) as info:
        parse_chat(chat_body(**strict_format(schema)))
    assert info.value.status == 400 and says in info.value.message, info.value.message
    assert "strict" in info.value.message
    # without strict the schema is taken (and enforced by guided decoding as it is)
    loose = strict_format(schema)
    loose["response_format"]["json_schema"]["strict"] = False
    assert parse_chat(chat_body(**loose)).response_format is not None


def test_strict_accepts_a_strict_schema_with_nesting_refs_and_nullable_fields() -> None:
    inner = {"type": "object", "properties": {"b": {"type": ["string", "null"]}},
             "required": ["b"], "additionalProperties": False}
    schema = {**SCHEMA, "properties": {"a": {"$ref": "#/$defs/inner"},
                                       "c": {"type": "array", "items": inner},
                                       "d": {"anyOf": [inner, {"type": "null"}]}},
              "required": ["a", "c", "d"], "$defs": {"inner": inner}}
    parse_chat(chat_body(**strict_format(schema)))


def chat_body(**fields: Any) -> bytes:
    return json.dumps({"model": "tiny", "messages": MESSAGES, **fields}).encode()


def completion_body(**fields: Any) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "hi", **fields}).encode()


@pytest.fixture(scope="module")
def pre(tiny_model: Path) -> Preprocessor:
    return Preprocessor(tiny_model, build_card(tiny_model, "tiny"))


@pytest.mark.parametrize(("fields", "param", "guided"), CONSTRAINTS)
def test_constraints_become_guided_decoding(pre, fields, param, guided) -> None:
    asked: list[tuple[str, str]] = []

    def require(capability: str, name: str) -> None:
        asked.append((capability, name))

    chat = pre.chat(parse_chat(chat_body(**fields)), require)
    completion = pre.completion(parse_completion(completion_body(**fields)), require)
    assert chat.guided == guided and completion.guided == guided
    assert asked == [(Capability.STRUCTURED_OUTPUTS, param)] * 2


def test_free_text_has_no_constraint(pre) -> None:
    def require(capability: str, name: str) -> None:
        raise AssertionError(f"{name} needs nothing")

    for fields in ({}, {"response_format": {"type": "text"}}):
        assert pre.chat(parse_chat(chat_body(**fields)), require).guided is None
        assert pre.completion(parse_completion(completion_body(**fields)), require).guided is None


@pytest.mark.parametrize(("fields", "param"), MALFORMED)
def test_malformed_constraints_are_400_naming_the_parameter(fields, param) -> None:
    for parse, body in ((parse_chat, chat_body), (parse_completion, completion_body)):
        with pytest.raises(HttpError) as info:
            parse(body(**fields))
        assert info.value.status == 400 and info.value.param == param, info.value.message


# -- through processes --------------------------------------------------------------------------


async def test_malformed_constraints_are_refused_without_a_worker(namespace, spawn):
    """A frontend with no worker at all: each malformed constraint is a 400 (not 404 for the
    unknown model, not 503), from the real `openai` client."""
    url = start_frontend(spawn, namespace, mode=None, ready=True).address
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
        for fields, param in MALFORMED:
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model="tiny", messages=MESSAGES,
                                                     extra_body=fields)
            assert info.value.body["param"] == param
            with pytest.raises(openai.BadRequestError) as info:
                await client.completions.create(model="tiny", prompt="hi", extra_body=fields)
            assert info.value.body["param"] == param


async def test_the_mocker_refuses_every_constraint_naming_engine_and_parameter(
    namespace, spawn, tiny_model
):
    start_worker(spawn, namespace, tiny_model, ready=True)
    url = start_frontend(spawn, namespace, mode=None, ready=True).address
    await wait_models(url, {"tiny"})
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
        for fields, param, _ in CONSTRAINTS:
            for stream in (False, True):
                with pytest.raises(openai.BadRequestError) as info:
                    await client.chat.completions.create(
                        model="tiny", messages=MESSAGES, stream=stream, extra_body=fields
                    )
                body = info.value.body
                assert body["param"] == param and body["code"] == "unsupported_parameter"
                assert "mocker" in body["message"] and f"'{param}'" in body["message"]
                with pytest.raises(openai.BadRequestError) as info:
                    await client.completions.create(model="tiny", prompt="hi", stream=stream,
                                                    extra_body=fields)
                assert info.value.body["param"] == param
                assert "mocker" in info.value.body["message"]
        # Free text still works on the mocker.
        resp = await client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=3, response_format={"type": "text"}
        )
        assert resp.choices[0].finish_reason == "length"
