"""Errors of the Responses and Messages APIs name the client's own fields, not chat's.

Both APIs are translated into the internal chat request, whose checks (and preprocessing's)
name chat's fields; ``frontend/_api_params.py`` renames them on the way out. Shown through a
real frontend and mocker worker with the real ``openai`` and ``anthropic`` clients:
``text.format.name``, ``tools[0].description``, ``max_output_tokens`` and ``input`` in a 413
(Responses); ``stop_sequences``, ``tool_choice`` of type ``any``, a named tool, Anthropic's
``max_tokens`` (Messages, count_tokens too). The index mapping (a chat message back to the
input item or Anthropic block it came from, past the added ``instructions`` / ``system``) is
shown on the translation itself, since no check reachable today names a chat message's index.
"""

from __future__ import annotations

import json
import time
import uuid

import anthropic
import openai
import pytest

from dynamo_zmq.frontend._anthropic_protocol import parse_messages
from dynamo_zmq.frontend._api_params import messages_names, responses_names
from dynamo_zmq.frontend.errors import bad_request
from tests.support.http_calls import get
from tests.support.procs import Proc

TOOLS = [{"type": "function", "name": "get_time", "parameters": {"type": "object"}}]
CLAUDE_TOOLS = [{"name": "get_time", "input_schema": {"type": "object"}}]
#: Over any tokenization's fit in tiny's 2048-token context (a 413 before tokenizing).
HUGE = "hello world " * 125_000


@pytest.fixture(scope="module")
def url(tiny_model):
    """A mocker worker serving 'tiny' and a frontend: the frontend's URL."""
    namespace = f"t{uuid.uuid4().hex[:12]}"
    procs = [Proc(["-m", "dynamo_zmq.worker", "--namespace", namespace, "--host", "127.0.0.1",
                   "--engine", "mocker", "--model-path", str(tiny_model), "--model-name",
                   "tiny", "--speedup-ratio", "1000"]),
             Proc(["-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace", namespace])]
    try:
        for proc in procs:
            proc.wait_ready(60)
        address = procs[-1].address
        deadline = time.monotonic() + 60
        while True:
            status, body = get(f"{address}/v1/models")
            if status == 200 and "tiny" in {m["id"] for m in json.loads(body)["data"]}:
                break
            assert time.monotonic() < deadline, f"tiny not listed: {body!r}"
            time.sleep(0.1)
        yield address
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture
async def openai_client(url):
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                  timeout=60) as c:
        yield c


@pytest.fixture
async def claude(url):
    async with anthropic.AsyncAnthropic(base_url=url, api_key="none", max_retries=0,
                                        timeout=60) as c:
        yield c


CHAT_NAMES = ("messages", "response_format", "max_completion_tokens", "json_schema",
              ".function")


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"text": {"format": {"type": "json_schema", "name": 5, "schema": {"type": "object"}}}},
     "text.format.name"),
    ({"tools": [{**TOOLS[0], "description": 5}]}, "tools[0].description"),
    ({"tools": [{**TOOLS[0], "parameters": [1]}]}, "tools[0].parameters"),
    ({"input": [{"type": "reasoning", "summary": 5}, {"role": "user", "content": "Hi"}]},
     "input[0].summary"),
    ({"tool_choice": "required"}, "tool_choice"),
])
async def test_responses_400s_name_the_responses_fields(openai_client, kwargs, param):
    body = {"model": "tiny", "input": "Hi", "instructions": "Be brief.", **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        await openai_client.responses.create(**body)
    err = info.value.body
    assert err["param"] == param and f"'{param}'" in err["message"], err
    assert not any(name in err["message"] for name in CHAT_NAMES), err


async def test_responses_413s_name_input_and_max_output_tokens(openai_client):
    with pytest.raises(openai.APIStatusError) as info:
        await openai_client.responses.create(model="tiny", input=HUGE, instructions="Be brief.")
    err = info.value.body
    assert info.value.status_code == 413 and err["param"] == "input", err
    assert "the input has" in err["message"] and "messages" not in err["message"], err
    with pytest.raises(openai.APIStatusError) as info:
        await openai_client.responses.create(model="tiny", input="Hi", max_output_tokens=4000)
    err = info.value.body
    assert info.value.status_code == 413 and err["param"] == "max_output_tokens", err
    assert "in the input" in err["message"] and "messages" not in err["message"], err


async def test_messages_errors_name_anthropics_fields(claude):
    ask = [{"role": "user", "content": "Hi"}]
    cases = [
        ({"stop_sequences": [f"s{i}" for i in range(100)]}, "'stop_sequences': at most"),
        ({"tool_choice": {"type": "any"}}, "'tool_choice' of type 'any' needs 'tools'"),
        ({"tools": CLAUDE_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
         "'tool_choice' names the tool 'nope', which is not in 'tools'"),
    ]
    for kwargs, message in cases:
        with pytest.raises(anthropic.BadRequestError) as info:
            await claude.messages.create(model="tiny", max_tokens=5, messages=ask,
                                         system="Be brief.", **kwargs)
        err = info.value.body["error"]
        assert err["type"] == "invalid_request_error" and message in err["message"], err
    with pytest.raises(anthropic.BadRequestError) as info:  # count_tokens: the same checks
        await claude.messages.count_tokens(model="tiny", messages=ask,
                                           tool_choice={"type": "any"})
    assert "'tool_choice' of type 'any'" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.APIStatusError) as info:  # over the context: its max_tokens
        await claude.messages.create(model="tiny", max_tokens=4000, messages=ask)
    err = info.value.body["error"]
    assert info.value.status_code == 413 and "4000 in the completion" in err["message"], err
    assert "max_completion_tokens" not in err["message"]


def test_chat_message_indexes_map_back_to_their_item_or_block():
    """The instructions / system prompt, a stored conversation, merged function calls and a
    user's tool results shift chat's indexes; the renamed error names the client's own."""
    names = responses_names([{"role": "user", "content": "x"}, {"type": "reasoning"},
                             {"role": "assistant", "content": "a"}, {"type": "function_call"},
                             {"type": "function_call_output"}], instructions=True, stored=2)
    assert [names.path(p) for p in ("messages[0].content", "messages[1]", "messages[3].content[1]",
                                    "messages[4].tool_calls[0]", "messages[5].content")] == [
        "instructions", "previous_response_id", "input[0].content[1]", "input[2]",
        "input[4].output"]
    req = parse_messages(json.dumps({"model": "m", "max_tokens": 5, "system": "s", "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": "x"},
                                     {"type": "text", "text": "hi"},
                                     {"type": "text", "text": "ho"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t"},
                                          {"type": "text", "text": "x"}]}]}).encode())
    claude = messages_names(bool(req.system), req.messages)
    err = claude.rename(bad_request("'messages[2].content[1]' is wrong",
                                    param="messages[2].content[1]"))
    assert err.param == "messages[0].content[2]" and err.message == (
        "'messages[0].content[2]' is wrong")
    assert [claude.path(p) for p in ("messages[0].content", "messages[1].content",
                                     "messages[3].content[0]", "stop",
                                     "tools[1].function.parameters")] == [
        "system", "messages[0].content[0].content", "messages[1].content[1]",
        "stop_sequences", "tools[1].input_schema"]
