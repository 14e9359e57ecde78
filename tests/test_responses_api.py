"""OpenAI's Responses API (``POST /v1/responses``) through a real frontend and real workers,
with the ``openai`` client's ``responses`` calls.

A scripted engine (``tests.support.engines:ScriptedEngine``) writes each script through the
worker's real detokenizer and parsers (its model's chat template implies the hermes tool parser
and the qwen3 reasoning parser, and it declares structured outputs); a mocker lacks structured
outputs. Shown: text and message input, ``instructions`` as chat's system message (the same
prompt tokens as the equivalent chat request), the streamed events in OpenAI's order with their
sequence numbers (and the client's stream helper assembling the same response), reasoning and
function-call items, a tool round trip, ``text.format``, ``max_output_tokens`` cutting a
response short, a stream whose engine crashes ending with ``response.failed``, the store
(``previous_response_id``, retrieve, delete, eviction) and errors in OpenAI's shape.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid

import openai
import pytest

from tests.support.http_calls import get, post
from tests.support.procs import Proc, run_cli

W = {"city": "Paris", "days": 3}
T = {"tz": "Europe/Paris"}
HERMES = (f"Let me check.\n<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': W})}\n"
          f"</tool_call>\n<tool_call>\n{json.dumps({'name': 'get_time', 'arguments': T})}\n"
          "</tool_call>")
SCRIPTS = {
    "default": "Hello there.",
    "hermes": HERMES,
    "think": "<think>\nPondering é 日本.\n</think>\n\nThe answer is 4.",
    "named": json.dumps(T),
}
TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}},
    {"type": "function", "name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}}},
]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
              for t in TOOLS]
STORE_SIZE = 3
#: The tiny model's template, taking tool calls and results (its <tool_call> and </think>
#: imply the hermes and qwen3 parsers).
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}<tool_call>{{ call['function']['name'] }} "
    "{{ call['function']['arguments'] }}</tool_call>{% endfor %}{{ eos_token + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
    "{# <think></think> #}"
)
SCHEMA = {"type": "json_schema", "name": "tz",
          "schema": {"type": "object", "properties": {"tz": {"type": "string"}}}}


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    """A scripted worker ('qwen': hermes and qwen3 from its chat template, which takes tool
    calls and results, and structured outputs), a mocker ('mocker'), an engine that crashes
    after 3 tokens ('crash') and a frontend keeping at most ``STORE_SIZE`` responses, without
    migration: its URL."""
    tmp = tmp_path_factory.mktemp("responses")
    scripts = tmp / "scripts.json"
    scripts.write_text(json.dumps(SCRIPTS))
    qwen_model = tmp / "qwen-like"
    shutil.copytree(tiny_model, qwen_model)
    config_file = qwen_model / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    config_file.write_text(json.dumps(config))
    namespace = f"t{uuid.uuid4().hex[:12]}"
    base = ["-m", "dynamo_zmq.worker", "--namespace", namespace, "--host", "127.0.0.1",
            "--grace-period", "0"]
    procs: list[Proc] = []
    try:
        procs.append(Proc([*base, "--engine", "tests.support.engines:ScriptedEngine",
                           "--model-name", "qwen", "--model-path", str(qwen_model),
                           "--scripted-structured", "--script-file", str(scripts)]))
        procs.append(Proc([*base, "--engine", "mocker", "--model-path", str(tiny_model),
                           "--model-name", "mocker", "--speedup-ratio", "1000"]))
        procs.append(Proc([*base, "--engine", "tests.support.engines:CrashingTestEngine",
                           "--model-path", str(tiny_model), "--model-name", "crash",
                           "--crash-after", "3"]))
        front = Proc(["-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace", namespace,
                      "--responses-store-size", str(STORE_SIZE), "--migration-limit", "0"])
        procs.append(front)
        for proc in procs:
            proc.wait_ready(60)
        deadline = time.monotonic() + 60
        while True:
            status, body = get(f"{front.address}/v1/models")
            if status == 200 and {"qwen", "mocker", "crash"} <= {m["id"] for m in
                                                        json.loads(body)["data"]}:
                break
            assert time.monotonic() < deadline, f"models not listed: {body!r}"
            time.sleep(0.1)
        yield front.address
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture
async def client(stack):
    async with openai.AsyncOpenAI(base_url=f"{stack}/v1", api_key="none", max_retries=0) as c:
        yield c


async def chat_prompt_tokens(client, messages, **kwargs) -> int:
    """The prompt tokens of the equivalent chat request."""
    resp = await client.chat.completions.create(model="qwen", messages=messages, **kwargs)
    return resp.usage.prompt_tokens


async def events_of(client, **kwargs) -> list:
    stream = await client.responses.create(stream=True, **kwargs)
    return [event async for event in stream]


def kinds(events) -> list[str]:
    """The event types, runs of the same delta type as one."""
    out: list[str] = []
    for event in events:
        if not (event.type.endswith(".delta") and out and out[-1] == event.type):
            out.append(event.type)
    return out


ITEM = ["response.output_item.added", "response.content_part.added"]
ITEM_DONE = ["response.content_part.done", "response.output_item.done"]


async def test_text_input_with_instructions_is_the_chat_with_a_system_message(client):
    resp = await client.responses.create(
        model="qwen", input="Say hello. script=default", instructions="Be brief.",
        max_output_tokens=50, temperature=0.5, top_p=0.9)
    assert resp.object == "response" and resp.status == "completed"
    assert resp.id.startswith("resp_") and resp.model == "qwen"
    assert resp.output_text == "Hello there."
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert [p.type for p in item.content] == ["output_text"]
    assert (resp.instructions, resp.max_output_tokens, resp.temperature, resp.top_p) == (
        "Be brief.", 50, 0.5, 0.9)
    usage = resp.usage
    assert usage.input_tokens == await chat_prompt_tokens(client, [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say hello. script=default"}])
    assert usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    # message items with input_text parts (as chat's text parts), developer as system
    same = await client.responses.create(model="qwen", input=[
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Say hello."},
                     {"type": "input_text", "text": "script=default"}]}])
    assert same.output_text == "Hello there."
    assert same.usage.input_tokens == await chat_prompt_tokens(client, [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Say hello."},
                                     {"type": "text", "text": "script=default"}]}])


async def test_streamed_events_come_in_openais_order_with_sequence_numbers(client):
    events = await events_of(client, model="qwen", input="Think. script=think")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds(events) == [
        "response.created", "response.in_progress",
        *ITEM, "response.reasoning_text.delta", "response.reasoning_text.done", *ITEM_DONE,
        *ITEM, "response.output_text.delta", "response.output_text.done", *ITEM_DONE,
        "response.completed",
    ]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert final.status == "completed"
    reasoning, message = final.output
    assert reasoning.type == "reasoning"
    assert reasoning.content[0].text == "\nPondering é 日本.\n"
    assert message.type == "message" and final.output_text == "\n\nThe answer is 4."
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text
    thoughts = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thoughts == reasoning.content[0].text
    assert {e.item_id for e in events if e.type == "response.output_text.delta"} == {message.id}
    assert final.usage.output_tokens > final.usage.output_tokens_details.reasoning_tokens > 0
    whole = await client.responses.create(model="qwen", input="Think. script=think")
    assert [i.type for i in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == reasoning.content[0].text
    assert whole.output_text == final.output_text
    assert whole.usage.input_tokens == final.usage.input_tokens


async def test_a_mocker_worker_streams_a_response(client):
    events = await events_of(client, model="mocker", input="Tell me a story.",
                             max_output_tokens=8)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert events[-1].type in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text
    assert 0 < final.usage.output_tokens <= 8
    whole = await client.responses.create(model="mocker", input="Tell me a story.",
                                          max_output_tokens=8)
    assert whole.usage.input_tokens == final.usage.input_tokens


async def test_a_stream_that_fails_ends_with_response_failed(client):
    events = await events_of(client, model="crash", input="one two three four five six")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.failed"
    assert any(e.type == "response.output_text.delta" for e in events)
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.message and failed.error.code
    with pytest.raises(openai.NotFoundError):  # a failed response is not stored
        await client.responses.retrieve(failed.id)


async def test_the_clients_stream_helper_assembles_the_response(client):
    async with client.responses.stream(model="qwen", input="Hi script=default") as stream:
        texts = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert "".join(texts) == final.output_text == "Hello there."
    assert final.status == "completed" and final.usage.total_tokens > 0


async def test_function_calls_and_a_tool_round_trip(client):
    resp = await client.responses.create(model="qwen", input="Weather? script=hermes",
                                         tools=TOOLS)
    message, *calls = resp.output
    assert message.type == "message" and resp.output_text == "Let me check."
    assert [(c.type, c.name, json.loads(c.arguments)) for c in calls] == [
        ("function_call", "get_weather", W), ("function_call", "get_time", T)]
    assert all(c.call_id.startswith("call_") and c.status == "completed" for c in calls)
    events = await events_of(client, model="qwen", input="Weather? script=hermes", tools=TOOLS)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    calls_done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.name, json.loads(e.arguments)) for e in calls_done] == [
        ("get_weather", W), ("get_time", T)]
    for done in calls_done:
        pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"
                  and e.item_id == done.item_id]
        assert "".join(pieces) == done.arguments
    assert kinds(events)[-4:] == ["response.function_call_arguments.delta",
                                  "response.function_call_arguments.done",
                                  "response.output_item.done", "response.completed"]
    # the calls' results go back as function_call_output items
    follow_up = [{"role": "user", "content": "Weather? script=hermes"},
                 *[{"type": "function_call", "call_id": c.call_id, "name": c.name,
                    "arguments": c.arguments} for c in calls],
                 *[{"type": "function_call_output", "call_id": c.call_id,
                    "output": f"{c.name} done script=default"} for c in calls]]
    answer = await client.responses.create(model="qwen", input=follow_up, tools=TOOLS)
    assert answer.output_text == "Hello there."
    as_chat = [{"role": "user", "content": "Weather? script=hermes"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": c.call_id, "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments}} for c in calls]},
               *[{"role": "tool", "tool_call_id": c.call_id,
                  "content": f"{c.name} done script=default"} for c in calls]]
    assert answer.usage.input_tokens == await chat_prompt_tokens(client, as_chat,
                                                                 tools=CHAT_TOOLS)


async def test_text_format_is_guided_decoding_and_refused_without_structured_outputs(client):
    resp = await client.responses.create(model="qwen", input="Zone? script=named",
                                         text={"format": SCHEMA})
    assert json.loads(resp.output_text) == T
    assert resp.text.format.type == "json_schema"
    for fmt in (SCHEMA, {"type": "json_object"}):
        with pytest.raises(openai.BadRequestError) as info:
            await client.responses.create(model="mocker", input="Zone?", text={"format": fmt})
        err = info.value.body
        assert err["param"] == "text.format" and "mocker" in err["message"]
        assert err["code"] == "unsupported_parameter"


async def test_max_output_tokens_makes_the_response_incomplete(client):
    resp = await client.responses.create(model="qwen", input="Hi script=default",
                                         max_output_tokens=2)
    assert resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 2
    events = await events_of(client, model="qwen", input="Hi script=default",
                             max_output_tokens=2)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == resp.output_text


async def test_previous_response_id_continues_the_stored_conversation(client):
    first = await client.responses.create(model="qwen", input="First. script=default",
                                          instructions="Be brief.")
    assert first.store is True
    second = await client.responses.create(model="qwen", input="Second.",
                                           previous_response_id=first.id)
    assert second.previous_response_id == first.id
    # the previous instructions are not carried over; its output is
    assert second.usage.input_tokens == await chat_prompt_tokens(client, [
        {"role": "user", "content": "First. script=default"},
        {"role": "assistant", "content": "Hello there."},
        {"role": "user", "content": "Second."}])
    got = await client.responses.retrieve(first.id)
    assert (got.id, got.output_text, got.status) == (first.id, "Hello there.", "completed")
    # streamed responses are stored too
    events = await events_of(client, model="qwen", input="Third.",
                             previous_response_id=second.id)
    third = events[-1].response
    assert (await client.responses.retrieve(third.id)).output_text == third.output_text
    await client.responses.delete(third.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(third.id)


async def test_unknown_unstored_and_evicted_responses_are_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        await client.responses.create(model="qwen", input="Hi", previous_response_id="resp_x")
    err = info.value.body
    assert err["param"] == "previous_response_id" and err["code"] == "response_not_found"
    assert "resp_x" in err["message"] and err["type"] == "invalid_request_error"
    unstored = await client.responses.create(model="qwen", input="Hi", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unstored.id)
    oldest = await client.responses.create(model="qwen", input="Hi")
    newer = [await client.responses.create(model="qwen", input="Hi") for _ in range(STORE_SIZE)]
    with pytest.raises(openai.NotFoundError):  # beyond --responses-store-size: the oldest go
        await client.responses.retrieve(oldest.id)
    for resp in newer:
        assert (await client.responses.retrieve(resp.id)).id == resp.id


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"temperature": 3}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [  # an image, to an engine without vision
        {"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
])
async def test_bad_requests_are_400_in_openais_error_shape(client, kwargs, param):
    body = {"model": "qwen", "input": "Hi", **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(**body)
    err = info.value.body
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["message"]


def test_malformed_bodies_and_methods_get_openais_errors(stack):
    status, body = post(f"{stack}/v1/responses", b'{"model": "qwen", "input": ')
    assert status == 400 and json.loads(body)["error"]["code"] == "invalid_json"
    status, body = post(f"{stack}/v1/responses", b'{"model": "qwen", "input": 5}')
    assert status == 400 and json.loads(body)["error"]["param"] == "input"
    status, body = get(f"{stack}/v1/responses")
    assert status == 405 and json.loads(body)["error"]["type"] == "invalid_request_error"
    status, body = get(f"{stack}/v1/responses/resp_nope")
    assert status == 404 and json.loads(body)["error"]["code"] == "response_not_found"


async def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        await client.responses.create(model="nope", input="Hi")
    assert info.value.body["code"] == "model_not_found"


def test_store_flags_are_checked():
    for argv, message in ((("--responses-store-size", "-1"), "--responses-store-size must be"),
                          (("--responses-store-ttl", "0"), "--responses-store-ttl must be")):
        done = run_cli("-m", "dynamo_zmq.frontend", "--http-port", "0", *argv)
        assert done.returncode == 2 and message in done.stderr
    done = run_cli("-m", "dynamo_zmq.frontend", "--http-port", "0",
                   env={"DYN_RESPONSES_STORE_SIZE": "-2"})
    assert done.returncode == 2 and "got -2" in done.stderr

