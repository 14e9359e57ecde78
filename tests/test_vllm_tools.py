"""``tool_choice: "required"`` with the vLLM engine: the frontend constrains the output to a JSON
array of calls (structured outputs) and the worker reads it as tool calls, which are valid even
from the random-weight test model.

Runs only where vLLM is installed (skipped otherwise, failed in CI: see tests/test_vllm.py).
"""

from __future__ import annotations

import json

import pytest

import tests.support.needs_vllm  # noqa: F401  (skips this module without vLLM; fails it in CI)

# isort: split

import openai

from tests.support.vllm_stack import wait_listed

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

#: Tools whose arguments are enums, so a random model's constrained output is short.
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
        "required": ["zone"], "additionalProperties": False}}},
]
ENUMS = {"get_weather": ("unit", {"c", "f"}), "get_time": ("zone", {"utc", "cet"})}


@pytest.fixture(scope="module")
def url(tiny_vllm_stack):
    """The session's shared vLLM worker and frontend."""
    wait_listed(tiny_vllm_stack.url)
    return tiny_vllm_stack.url


def check(calls) -> None:
    assert calls, "tool_choice=required gave no tool call"
    for name, arguments in calls:
        key, allowed = ENUMS[name]
        args = json.loads(arguments)
        assert isinstance(args, dict) and set(args) == {key} and args[key] in allowed


async def test_tool_choice_required_gives_valid_tool_calls(url):
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
        kwargs = {"model": "tiny", "messages": [{"role": "user", "content": "Weather or time?"}],
                  "tools": TOOLS, "tool_choice": "required", "max_tokens": 200,
                  "temperature": 0.0,
                  # one call: a random model may otherwise add calls to the array forever
                  "parallel_tool_calls": False}
        resp = await client.chat.completions.create(**kwargs)
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls) == 1  # parallel_tool_calls: false
        check([(c.function.name, c.function.arguments) for c in choice.message.tool_calls])
        stream = await client.chat.completions.create(stream=True, **kwargs)
        calls: dict[int, list[str]] = {}
        finish = None
        async for chunk in stream:
            for d in chunk.choices[0].delta.tool_calls or ():
                calls.setdefault(d.index, [d.function.name or "", ""])[1] += (
                    d.function.arguments or "")
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        assert [tuple(calls[i]) for i in sorted(calls)] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls]
