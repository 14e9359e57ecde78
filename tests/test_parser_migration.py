"""Tool-call and reasoning parsing across a migration, and ``parallel_tool_calls: false``
(issue 36 item 5).

Scripted workers (``tests.support.engines:ScriptedEngine``, one token every few milliseconds)
write a tool call with long arguments, or long reasoning, through the worker's real hermes and
qwen3 parsers. A worker killed in the middle of the call (or the reasoning) is replaced by
another, whose post-processing replays the streamed output through its parsers: the call's
arguments go on as arguments of the same call (same index, same id), the reasoning as
reasoning, and everything concatenated equals a run without a fault. With
``parallel_tool_calls: false`` and ``tool_choice: auto`` only the first of two calls comes back.
"""

from __future__ import annotations

import asyncio
import json
import signal
import uuid

import openai
import pytest

from tests.support.migration import serving_worker
from tests.support.procs import Proc
from tests.support.waiting import serving

SCRIPTED = "tests.support.engines:ScriptedEngine"
ARGS = {"city": "Paris", "notes": " ".join(f"item{i}" for i in range(40))}
SCRIPTS = {
    "default": "Hello.",  # the health canary's
    "call": "Let me look.\n<tool_call>\n"
            + json.dumps({"name": "get_weather", "arguments": ARGS}) + "\n</tool_call>",
    "think": "<think>" + " ".join(f"step{i}" for i in range(60)) + "</think>\n\nIt is sunny.",
    "two": "<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}})
           + "\n</tool_call>\n<tool_call>\n"
           + json.dumps({"name": "get_time", "arguments": {"zone": "CET"}}) + "\n</tool_call>",
}
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("get_weather", "get_time")
]
#: Tool-call or reasoning chunks the client reads before its worker is killed.
BEFORE = 8


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    """Three slow scripted workers (hermes and qwen3 parsers) behind a round-robin frontend:
    each migration test loses one. Yields (frontend URL, workers)."""
    scripts = tmp_path_factory.mktemp("parser_migration") / "scripts.json"
    scripts.write_text(json.dumps(SCRIPTS))
    namespace = f"t{uuid.uuid4().hex[:12]}"
    base = ["-m", "dynamo_zmq.worker", "--namespace", namespace, "--host", "127.0.0.1",
            "--grace-period", "0", "--engine", SCRIPTED, "--model-name", "tiny",
            "--model-path", str(tiny_model), "--script-file", str(scripts),
            "--script-delay", "0.02", "--tool-call-parser", "hermes",
            "--reasoning-parser", "qwen3"]
    workers = [Proc(base) for _ in range(3)]
    front = Proc(["-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace", namespace,
                  "--router-mode", "round-robin"])
    try:
        url = asyncio.run(serving(front, workers, "tiny", 60))
        yield url, workers
    finally:
        for proc in [front, *workers]:
            proc.stop()


@pytest.fixture
async def client(stack):
    async with openai.AsyncOpenAI(base_url=f"{stack[0]}/v1", api_key="none",
                                  max_retries=0, timeout=60) as c:
        yield c


def ask(script: str) -> list[dict]:
    return [{"role": "user", "content": f"Go on. script={script}"}]


async def streamed(client, workers, script: str, kill_after: str | None, **kwargs) -> dict:
    """Stream the script's chat; with ``kill_after`` (``tool_calls`` or ``reasoning``) SIGKILL
    its worker after ``BEFORE`` such chunks. Returns content, reasoning, the calls (index ->
    id, name, concatenated arguments) and the finish reason."""
    raw = await client.chat.completions.with_raw_response.create(
        model="tiny", messages=ask(script), stream=True, **kwargs)
    victim = serving_worker(workers, raw.headers["x-dynamo-worker"])
    out: dict = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    seen = 0
    async for chunk in raw.parse():
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        out["content"] += delta.content or ""
        thought = (delta.model_extra or {}).get("reasoning_content") or ""
        out["reasoning"] += thought
        for d in delta.tool_calls or ():
            call = out["calls"].setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:
                assert call["id"] is None, "a call's id went out twice"
                call["id"] = d.id
            if d.function and d.function.name:
                assert call["name"] is None, "a call's name went out twice"
                call["name"] = d.function.name
            call["arguments"] += (d.function.arguments or "") if d.function else ""
        hit = delta.tool_calls if kill_after == "tool_calls" else thought
        if kill_after and hit:
            seen += 1
            if seen == BEFORE:
                victim.signal(signal.SIGKILL)
        if choice.finish_reason:
            out["finish"] = choice.finish_reason
    if kill_after:
        assert seen > BEFORE, "the worker was not killed mid-stream"
        assert victim.wait(30) is not None
    return out


async def test_a_tool_call_cut_by_a_migration_goes_on_as_the_same_call(stack, client):
    _, workers = stack
    ref = await streamed(client, workers, "call", None, tools=TOOLS)
    assert [c["name"] for c in ref["calls"].values()] == ["get_weather"]
    assert json.loads(ref["calls"][0]["arguments"]) == ARGS
    got = await streamed(client, workers, "call", "tool_calls", tools=TOOLS)
    assert got["content"] == ref["content"] == "Let me look."
    assert got["finish"] == ref["finish"] == "tool_calls"
    assert list(got["calls"]) == [0]
    assert got["calls"][0]["name"] == "get_weather"
    assert got["calls"][0]["arguments"] == ref["calls"][0]["arguments"]
    assert got["calls"][0]["id"].startswith("call_")


async def test_reasoning_cut_by_a_migration_goes_on_as_reasoning(stack, client):
    _, workers = stack
    ref = await streamed(client, workers, "think", None)
    assert ref["reasoning"].startswith("step0 ") and ref["content"] == "\n\nIt is sunny."
    got = await streamed(client, workers, "think", "reasoning")
    assert got == ref


async def test_parallel_tool_calls_false_keeps_only_the_first_call(stack, client):
    _, workers = stack
    both = await streamed(client, workers, "two", None, tools=TOOLS)
    assert [c["name"] for c in both["calls"].values()] == ["get_weather", "get_time"]
    one = await streamed(client, workers, "two", None, tools=TOOLS, tool_choice="auto",
                         parallel_tool_calls=False)
    assert [c["name"] for c in one["calls"].values()] == ["get_weather"]
    assert json.loads(one["calls"][0]["arguments"]) == {"city": "Oslo"}
    assert one["finish"] == "tool_calls" and one["content"] == ""
    whole = await client.chat.completions.create(
        model="tiny", messages=ask("two"), tools=TOOLS, parallel_tool_calls=False)
    calls = whole.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"})]
    assert whole.choices[0].finish_reason == "tool_calls"
