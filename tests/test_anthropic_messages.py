"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``; issue 36 item 2)
through a real frontend and real workers, with the ``anthropic`` client.

A scripted worker (``tests.support.engines:ScriptedEngine``, hermes tool-call and qwen3
reasoning parsers) writes known text, so stop sequences, thinking and tool-use blocks and
their stream events are checked exactly; a mocker serves the rest, and echo workers fail or
are slow (an engine error, the deadline: errors in Anthropic's shape). A second frontend has API
keys and tenant limits (a request bucket of 2 refilled at 0.01/s, so the outcome does not
depend on timing): ``x-api-key`` and ``Authorization: Bearer`` are the same key and the same
tenant."""

from __future__ import annotations

import json
import shutil
import uuid

import anthropic
import httpx
import pytest

from tests.support.procs import Proc
from tests.support.waiting import wait_models

pytestmark = [pytest.mark.asyncio(loop_scope="module")]

W = {"city": "Paris", "days": 3}
T = {"tz": "Europe/Paris"}
HERMES = (f"Let me check.\n<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': W})}\n"
          f"</tool_call>\n<tool_call>\n{json.dumps({'name': 'get_time', 'arguments': T})}\n"
          "</tool_call>")
SCRIPTS = {
    "default": "Hello there.",
    "think": "<think>Pondering it.</think>\n\nThe answer is 4.",
    "think_tools": "<think>The user wants the weather.</think>\n\n" + HERMES,
}
TOOLS = [
    {"name": "get_weather", "description": "The weather in a city",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                                                       "days": {"type": "integer"}},
                      "required": ["city"]}},
    {"name": "get_time", "input_schema": {"type": "object",
                                          "properties": {"tz": {"type": "string"}}}},
]
KEY, OTHER_KEY = "sekret-1", "sekret-2"
ECHO = "tests.support.engines:EchoEngine"
LIMITS = """
[default]
requests_per_second = 0.01
burst = 2
"""


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    """A scripted worker ('scripted'), a mocker ('mocker'), echo workers that fail ('broken')
    and are slow ('slow'), an open frontend and one with API keys and tenant limits; yields the
    two frontends' URLs."""
    tmp = tmp_path_factory.mktemp("messages")
    scripts = tmp / "scripts.json"
    scripts.write_text(json.dumps(SCRIPTS))
    limits = tmp / "limits.toml"
    limits.write_text(LIMITS)
    # the scripted model's template also renders tools and tool results (the tiny one has
    # neither)
    tool_model = tmp / "tool-model"
    shutil.copytree(tiny_model, tool_model)
    config_file = tool_model / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    template = config["chat_template"].replace("'assistant']", "'assistant', 'tool']")
    config["chat_template"] = "{% if tools %}{{ tools | tojson }}{% endif %}" + template
    config_file.write_text(json.dumps(config))
    namespace = f"t{uuid.uuid4().hex[:12]}"
    base = ["-m", "dynamo_zmq.worker", "--namespace", namespace, "--host", "127.0.0.1"]
    procs = [
        Proc([*base, "--model-path", str(tool_model), "--engine",
              "tests.support.engines:ScriptedEngine", "--model-name",
              "scripted", "--script-file", str(scripts), "--tool-call-parser", "hermes",
              "--reasoning-parser", "qwen3"]),
        Proc([*base, "--model-path", str(tiny_model), "--engine", "mocker", "--model-name",
              "mocker", "--speedup-ratio", "1000"]),
        # streams the prompt back, then fails (an engine error); and a slow one (the deadline)
        Proc([*base, "--model-path", str(tiny_model), "--engine", ECHO, "--model-name",
              "broken", "--echo-finish", "error"]),
        Proc([*base, "--model-path", str(tiny_model), "--engine", ECHO, "--model-name",
              "slow", "--echo-delay", "0.5"]),
        Proc(["-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace", namespace]),
        Proc(["-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace", namespace,
              "--api-key", KEY, "--api-key", OTHER_KEY, "--tenant-limits", str(limits),
              "--api-key-exempt", "/health,/live,/metrics,/v1/models"]),
    ]
    try:
        for proc in procs:
            proc.wait_ready(60)
        yield procs[-2].address, procs[-1].address
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture
async def client(stack):
    await wait_models(stack[0], {"scripted", "mocker"})
    async with anthropic.AsyncAnthropic(base_url=stack[0], api_key="none", max_retries=0,
                                        timeout=30) as c:
        yield c


def ask(script: str) -> list[dict]:
    return [{"role": "user", "content": f"What now? script={script}"}]


def error_body(exc: anthropic.APIStatusError) -> dict:
    """The error's body, checked to be Anthropic's shape."""
    body = exc.body
    assert isinstance(body, dict) and set(body) == {"type", "error"}, body
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    return body["error"]


async def test_a_text_message_and_its_usage(client):
    msg = await client.messages.create(model="scripted", max_tokens=50, messages=ask("default"))
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == "scripted"
    assert [(b.type, b.text) for b in msg.content] == [("text", "Hello there.")]
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    counted = await client.messages.count_tokens(model="scripted", messages=ask("default"))
    assert msg.usage.input_tokens == counted.input_tokens > 0
    assert msg.usage.output_tokens > 0


async def test_count_tokens_uses_the_template_and_system(client):
    plain = (await client.messages.count_tokens(model="mocker", messages=ask("x"))).input_tokens
    system = "You are terse."
    with_system = await client.messages.count_tokens(model="mocker", messages=ask("x"),
                                                     system=system)
    as_blocks = await client.messages.count_tokens(
        model="mocker", messages=ask("x"), system=[{"type": "text", "text": system}])
    assert with_system.input_tokens == as_blocks.input_tokens > plain
    tools = [await client.messages.count_tokens(model="scripted", messages=ask("x"), **extra)
             for extra in ({}, {"tools": TOOLS})]
    assert tools[1].input_tokens > tools[0].input_tokens
    msg = await client.messages.create(model="mocker", max_tokens=3, messages=ask("x"),
                                       system=system)
    assert msg.usage.input_tokens == with_system.input_tokens


async def test_string_and_block_content_are_the_same_prompt(client):
    blocks = [{"role": "user", "content": [{"type": "text", "text": "What now? script=default"}]}]
    a = await client.messages.count_tokens(model="mocker", messages=ask("default"))
    b = await client.messages.count_tokens(model="mocker", messages=blocks)
    assert a.input_tokens == b.input_tokens


async def test_stream_helper_and_raw_events(client):
    async with client.messages.stream(model="scripted", max_tokens=50,
                                      messages=ask("default")) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text == "Hello there."
    assert [(b.type, b.text) for b in final.content] == [("text", "Hello there.")]
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0

    events = [e async for e in await client.messages.create(
        model="scripted", max_tokens=50, messages=ask("default"), stream=True)]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.usage.input_tokens > 0
    assert "".join(e.delta.text for e in events[2:-3]) == "Hello there."
    assert events[-2].delta.stop_reason == "end_turn"
    assert events[-2].usage.output_tokens == final.usage.output_tokens


async def test_stop_sequence_and_max_tokens(client):
    msg = await client.messages.create(model="scripted", max_tokens=50, messages=ask("default"),
                                       stop_sequences=["there"])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "there"
    assert msg.content[0].text == "Hello "
    async with client.messages.stream(model="scripted", max_tokens=50, messages=ask("default"),
                                      stop_sequences=["there"]) as stream:
        final = await stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "there")
    # (sampling options through extra_body: this client's create() has no temperature)
    short = await client.messages.create(model="scripted", max_tokens=2, messages=ask("default"),
                                         extra_body={"temperature": 0.5, "top_p": 0.9,
                                                     "top_k": 5})
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


async def test_thinking_blocks_from_the_reasoning_parser(client):
    msg = await client.messages.create(model="scripted", max_tokens=1100, messages=ask("think"),
                                       thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == "Pondering it."
    assert msg.content[1].text.strip() == "The answer is 4."
    async with client.messages.stream(model="scripted", max_tokens=100,
                                      messages=ask("think")) as stream:
        deltas = [e.delta.type async for e in stream if e.type == "content_block_delta"]
        final = await stream.get_final_message()
    assert {"thinking_delta", "text_delta"} == set(deltas)
    first = final.content[0]
    assert first.type == "thinking" and first.thinking == "Pondering it."
    off = await client.messages.create(model="scripted", max_tokens=100, messages=ask("think"),
                                       thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"] and "Pondering it." in off.content[0].text


async def test_tool_use_round_trip(client):
    msg = await client.messages.create(model="scripted", max_tokens=300, tools=TOOLS,
                                       messages=ask("think_tools"))
    assert msg.stop_reason == "tool_use"
    kinds = [b.type for b in msg.content]
    assert kinds[0] == "thinking" and [k for k in kinds if k != "text"] == [
        "thinking", "tool_use", "tool_use"]
    calls = [b for b in msg.content if b.type == "tool_use"]
    assert [(c.name, c.input) for c in calls] == [("get_weather", W), ("get_time", T)]
    assert all(c.id for c in calls) and len({c.id for c in calls}) == 2
    assert "Let me check." in "".join(b.text for b in msg.content if b.type == "text")

    async with client.messages.stream(model="scripted", max_tokens=300, tools=TOOLS,
                                      messages=ask("think_tools")) as stream:
        deltas = {e.delta.type async for e in stream if e.type == "content_block_delta"}
        final = await stream.get_final_message()
    assert "input_json_delta" in deltas and final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        ("get_weather", W), ("get_time", T)]

    results = [{"type": "tool_result", "tool_use_id": c.id, "content": "sunny script=default"}
               for c in calls]
    history = [*ask("think_tools"),
               {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
               {"role": "user", "content": results}]
    answer = await client.messages.create(model="scripted", max_tokens=50, tools=TOOLS,
                                          messages=history)
    assert [(b.type, b.text) for b in answer.content] == [("text", "Hello there.")]
    assert answer.stop_reason == "end_turn"
    with_results = await client.messages.count_tokens(model="scripted", tools=TOOLS,
                                                      messages=history)
    assert answer.usage.input_tokens == with_results.input_tokens


async def test_errors_in_anthropics_shape(client, stack):
    with pytest.raises(anthropic.NotFoundError) as info:
        await client.messages.create(model="nope", max_tokens=5, messages=ask("x"))
    assert error_body(info.value)["type"] == "not_found_error"
    assert "nope" in error_body(info.value)["message"]
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.count_tokens(model="nope", messages=ask("x"))
    bad = [
        ({"model": "mocker", "messages": ask("x")}, "max_tokens"),
        ({"model": "mocker", "max_tokens": 0, "messages": ask("x")}, "max_tokens"),
        ({"model": "mocker", "max_tokens": 5, "messages": ask("x"), "temperature": 1.5},
         "temperature"),
        ({"model": "mocker", "max_tokens": 5, "messages": []}, "messages"),
        ({"model": "mocker", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]},
         "role"),
        ({"model": "mocker", "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AAAA"}}]}]}, "vision"),
        ({"model": "mocker", "max_tokens": 5, "messages": ask("x"),
          "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search"),
        ({"model": "mocker", "max_tokens": 5, "messages": ask("x"),
          "thinking": {"type": "enabled", "budget_tokens": 10}}, "budget_tokens"),
        ({"model": "mocker", "max_tokens": 5, "messages": ask("x"), "stop_sequences": [""]},
         "stop_sequences"),
        ({"model": "mocker", "max_tokens": 5, "messages": ask("x"), "tools": TOOLS,
          "tool_choice": {"type": "any"}}, "mocker"),
    ]
    async with httpx.AsyncClient(timeout=30) as http:
        for body, names in bad:
            resp = await http.post(f"{stack[0]}/v1/messages", json=body)
            assert resp.status_code == 400, (body, resp.text)
            assert resp.json()["type"] == "error", resp.text
            err = resp.json()["error"]
            assert err["type"] == "invalid_request_error" and names in err["message"], err
        resp = await http.post(f"{stack[0]}/v1/messages", content=b"{not json")
        assert resp.status_code == 400
        assert resp.json()["error"]["type"] == "invalid_request_error"
        resp = await http.get(f"{stack[0]}/v1/messages")
        assert resp.status_code == 405 and resp.json()["type"] == "error"


async def test_engine_errors_and_the_deadline_in_anthropics_shape(client, stack):
    await wait_models(stack[0], {"broken", "slow"})
    with pytest.raises(anthropic.InternalServerError) as info:
        await client.messages.create(model="broken", max_tokens=50, messages=ask("x"))
    assert info.value.status_code == 500 and error_body(info.value)["type"] == "api_error"
    events = []
    with pytest.raises(anthropic.APIStatusError) as streamed:  # the SDK raises the error event
        async for event in await client.messages.create(model="broken", max_tokens=50,
                                                        messages=ask("x"), stream=True):
            events.append(event.type)
    assert events[0] == "message_start" and "message_stop" not in events
    assert streamed.value.body["error"]["type"] == "api_error"
    with pytest.raises(anthropic.APIStatusError) as late:
        await client.messages.create(model="slow", max_tokens=50, messages=ask("x"),
                                     extra_headers={"x-dynamo-request-timeout": "0.3"})
    assert late.value.status_code == 504
    assert error_body(late.value)["type"] == "timeout_error"


async def test_x_api_key_and_bearer_are_one_key_and_one_tenant(stack):
    url = stack[1]
    await wait_models(url, {"scripted", "mocker"})
    kwargs = {"base_url": url, "max_retries": 0, "timeout": 30}
    with pytest.raises(anthropic.AuthenticationError) as info:
        async with anthropic.AsyncAnthropic(api_key="wrong", **kwargs) as c:
            await c.messages.create(model="mocker", max_tokens=2, messages=ask("x"))
    assert error_body(info.value)["type"] == "authentication_error"
    async with httpx.AsyncClient(timeout=30) as http:  # no key at all
        resp = await http.post(f"{url}/v1/messages/count_tokens",
                               json={"model": "mocker", "messages": ask("x")})
        assert resp.status_code == 401, resp.text
        assert resp.json()["error"]["type"] == "authentication_error"
    # the key as 'x-api-key' (the client's own header for it varies with its version), and as
    # 'Authorization: Bearer'
    async with anthropic.AsyncAnthropic(api_key=None, auth_token=None,
                                        default_headers={"x-api-key": KEY},
                                        **kwargs) as by_header, \
            anthropic.AsyncAnthropic(auth_token=KEY, api_key=None, **kwargs) as by_bearer, \
            anthropic.AsyncAnthropic(api_key=OTHER_KEY, **kwargs) as other:
        # count_tokens spends no request of the tenant's budget
        assert (await by_header.messages.count_tokens(model="mocker",
                                                      messages=ask("x"))).input_tokens > 0
        await by_bearer.messages.create(model="mocker", max_tokens=2, messages=ask("x"))
        await by_header.messages.create(model="mocker", max_tokens=2, messages=ask("x"))
        # the bucket of 2 is spent, whichever header carried the key
        for c in (by_header, by_bearer):
            with pytest.raises(anthropic.RateLimitError) as info:
                await c.messages.create(model="mocker", max_tokens=2, messages=ask("x"))
            assert error_body(info.value)["type"] == "rate_limit_error"
        await other.messages.create(model="mocker", max_tokens=2, messages=ask("x"))
    async with httpx.AsyncClient(timeout=30) as http:  # an OpenAI route takes x-api-key too
        resp = await http.post(f"{url}/v1/chat/completions", headers={"x-api-key": OTHER_KEY},
                               json={"model": "mocker", "max_tokens": 2, "messages": ask("x")})
        assert resp.status_code == 200, resp.text
        resp = await http.post(f"{url}/v1/chat/completions", headers={"x-api-key": "wrong"},
                               json={"model": "mocker", "max_tokens": 2, "messages": ask("x")})
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
