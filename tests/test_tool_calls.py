"""Tool calls and reasoning through a real frontend and real workers, with the `openai` client.

A scripted engine (``tests.support.engines:ScriptedEngine``) emits each family's markup token by
token through the worker's real detokenizer and parsers: every family's calls stream as OpenAI
tool-call deltas that re-assemble to the non-streamed calls (the JSON families' arguments in
pieces, as the model writes them), ``finish_reason`` is ``tool_calls``, ``tool_choice: none``
leaves the text alone, markup cut short before a call's name comes back as content and a call
cut short after it stands with its arguments so far, ``required`` and a named function work on
an engine with structured outputs (and are refused on the mocker), and reasoning moves to
``reasoning_content``, alone or before tool calls.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid

import openai
import pytest
from tokenizers import Tokenizer

from dynamo_zmq.llm import ModelAdvert
from tests.support.http_calls import get
from tests.support.procs import Proc

W = {"city": "Paris", "days": 3}
T = {"tz": "Europe/Paris"}
HERMES = (f"Let me check.\n<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': W})}\n"
          f"</tool_call>\n<tool_call>\n{json.dumps({'name': 'get_time', 'arguments': T})}\n"
          "</tool_call>")
SCRIPTS = {
    "default": "Hello there.",
    "hermes": HERMES,
    "llama": f"<|python_tag|>{json.dumps({'name': 'get_weather', 'parameters': W})}; "
             f"{json.dumps({'name': 'get_time', 'parameters': T})}",
    "mistral": "[TOOL_CALLS] " + json.dumps([{"name": "get_weather", "arguments": W},
                                             {"name": "get_time", "arguments": T}]),
    "pythonic": "[get_weather(city='Paris', days=3), get_time(tz=\"Europe/Paris\")]",
    "broken": 'Sure <tool_call>{"name": "get_weather", "arguments": {"city": ',
    "broken_early": 'Sure <tool_call>{"name": "get_wea',
    "think": "<think>\nPondering é 日本.\n</think>\n\nThe answer is 4.",
    "think_tools": "<think>The user wants the weather.</think>\n\n" + HERMES,
    "r1": "Thinking it over.</think>Paris is sunny.",
    "required": json.dumps([{"name": "get_weather", "parameters": W}]),
    "named": json.dumps(T),
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}}}},
]
BOTH = [("get_weather", W), ("get_time", T)]
SCRIPTED = "tests.support.engines:ScriptedEngine"


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    """Scripted workers, one per parser setup, a mocker, and a frontend: yields its URL.
    'qwen' names no parser: its chat template (the tiny one plus a comment mentioning
    ``<tool_call>`` and ``</think>``) gives hermes and qwen3."""
    tmp = tmp_path_factory.mktemp("tools")
    scripts = tmp / "scripts.json"
    scripts.write_text(json.dumps(SCRIPTS))
    qwen_model = tmp / "qwen-like"
    shutil.copytree(tiny_model, qwen_model)
    config_file = qwen_model / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] += "{# tool calls: <tool_call>...</tool_call>; <think></think> #}"
    config_file.write_text(json.dumps(config))
    namespace = f"t{uuid.uuid4().hex[:12]}"
    base = ["-m", "dynamo_zmq.worker", "--namespace", namespace, "--host", "127.0.0.1",
            "--grace-period", "0"]
    workers = {
        "qwen": ["--model-path", str(qwen_model), "--scripted-structured"],
        "llama": ["--tool-call-parser", "llama3_json"],
        "mistral": ["--tool-call-parser", "mistral"],
        "pythonic": ["--tool-call-parser", "pythonic"],
        "r1": ["--reasoning-parser", "deepseek_r1"],
    }
    procs: list[Proc] = []
    addresses: dict[str, str] = {}
    try:
        for name, flags in workers.items():
            path = [] if "--model-path" in flags else ["--model-path", str(tiny_model)]
            procs.append(Proc([*base, "--engine", SCRIPTED, "--model-name", name, *path, *flags,
                               "--script-file", str(scripts)]))
        procs.append(Proc([*base, "--engine", "mocker", "--model-path", str(tiny_model),
                           "--model-name", "mocker", "--speedup-ratio", "1000"]))
        front = Proc(["-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace", namespace])
        procs.append(front)
        for proc in procs:
            proc.wait_ready(60)
        addresses = dict(zip([*workers, "mocker"], [p.address for p in procs], strict=False))
        deadline = time.monotonic() + 60
        names = {*workers, "mocker"}
        while True:
            status, body = get(f"{front.address}/v1/models")
            if status == 200 and names <= {m["id"] for m in json.loads(body)["data"]}:
                break
            assert time.monotonic() < deadline, f"models not listed: {body!r}"
            time.sleep(0.1)
        yield front.address, namespace, addresses
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture
async def client(stack):
    async with openai.AsyncOpenAI(base_url=f"{stack[0]}/v1", api_key="none", max_retries=0) as c:
        yield c


async def test_workers_advertise_their_parsers(stack, make_runtime):
    _, namespace, addresses = stack
    expected = {"qwen": ("hermes", "qwen3"),  # from the chat template
                "llama": ("llama3_json", None), "r1": (None, "deepseek_r1"),
                "mocker": (None, None)}
    for name, parsers in expected.items():
        rt = make_runtime(static=(addresses[name],))
        client = await rt.endpoint(f"{namespace}.backend.generate").client()
        await client.wait_for_instances(timeout=15)
        (peer,) = [p for p in await rt.peers() if p.description]
        (info,) = [e for e in peer.description.endpoints if e.name == "generate"]
        advert = ModelAdvert.from_metadata(info.metadata)
        assert advert is not None and advert.name == name
        assert (advert.tool_call_parser, advert.reasoning_parser) == parsers


def ask(script: str) -> list[dict]:
    return [{"role": "user", "content": f"What now? script={script}"}]


def args_of(raw: str) -> dict | str:
    """A call's arguments as an object, or as they came where they are no JSON (cut short)."""
    try:
        args = json.loads(raw)
    except ValueError:
        return raw
    assert isinstance(args, dict)
    return args


def calls_of(message) -> list[tuple[str, dict | str]]:
    out = []
    for call in message.tool_calls or ():
        assert call.type == "function" and call.id.startswith("call_")
        out.append((call.function.name, args_of(call.function.arguments)))
    return out


async def streamed(client, model: str, script: str, **kwargs) -> dict:
    """The streamed answer re-assembled: content, reasoning, calls (checking each call's first
    delta carries id, type and name), and the finish reason; ``deltas`` counts the tool-call
    deltas, ``pieces`` the non-empty argument pieces of each call, ``raw`` its arguments."""
    stream = await client.chat.completions.create(
        model=model, messages=ask(script), stream=True, **kwargs)
    content, reasoning, finish = [], [], None
    calls: dict[int, dict] = {}
    deltas = 0
    pieces: dict[int, int] = {}
    async for chunk in stream:
        choice = chunk.choices[0]
        delta = choice.delta
        content.append(delta.content or "")
        reasoning.append(getattr(delta, "reasoning_content", None) or "")
        for d in delta.tool_calls or ():
            deltas += 1
            if d.index not in calls:
                assert d.id and d.id.startswith("call_") and d.type == "function"
                assert d.function.name
                calls[d.index] = {"name": d.function.name, "args": ""}
            else:
                assert d.id is None
            calls[d.index]["args"] += d.function.arguments or ""
            pieces[d.index] = pieces.get(d.index, 0) + bool(d.function.arguments)
        if choice.finish_reason is not None:
            finish = choice.finish_reason
    assert sorted(calls) == list(range(len(calls)))
    return {
        "content": "".join(content), "reasoning": "".join(reasoning), "finish": finish,
        "calls": [(calls[i]["name"], args_of(calls[i]["args"])) for i in sorted(calls)],
        "deltas": deltas, "pieces": [pieces[i] for i in sorted(calls)],
        "raw": [calls[i]["args"] for i in sorted(calls)],
    }


def same(stream: dict, whole: dict) -> dict:
    """The streamed answer's fields that the non-streamed one has."""
    return {k: v for k, v in stream.items() if k in whole}


async def unary(client, model: str, script: str, raw: bool = False, **kwargs) -> dict:
    """The non-streamed answer (``raw``: with each call's arguments as they came)."""
    resp = await client.chat.completions.create(model=model, messages=ask(script), **kwargs)
    choice = resp.choices[0]
    message = choice.message
    out = {
        "content": message.content or "", "finish": choice.finish_reason,
        "reasoning": getattr(message, "reasoning_content", None) or "",
        "calls": calls_of(message),
    }
    if raw:
        out["raw"] = [c.function.arguments for c in message.tool_calls or ()]
    return out


@pytest.mark.parametrize(("model", "script", "content"), [
    ("qwen", "hermes", "Let me check."),
    ("llama", "llama", ""),
    ("mistral", "mistral", ""),
    ("pythonic", "pythonic", ""),
])
async def test_every_family_streams_and_returns_tool_calls(client, model, script, content):
    whole = await unary(client, model, script, tools=TOOLS)
    assert whole == {"content": content, "finish": "tool_calls", "reasoning": "", "calls": BOTH}
    stream = await streamed(client, model, script, tools=TOOLS, tool_choice="auto")
    assert stream["deltas"] >= 2 * len(BOTH)  # a first delta per call, then its arguments
    assert same(stream, whole) == whole


async def test_tool_choice_none_and_no_tools_leave_the_text_alone(client):
    for kwargs in ({"tools": TOOLS, "tool_choice": "none"}, {}):
        whole = await unary(client, "qwen", "hermes", **kwargs)
        assert whole == {"content": HERMES, "finish": "stop", "reasoning": "", "calls": []}
        stream = await streamed(client, "qwen", "hermes", **kwargs)
        assert (stream["content"], stream["calls"], stream["finish"]) == (HERMES, [], "stop")


async def test_unfinished_markup_comes_back_as_content(client):
    # markup cut short before a call's name is complete (a call cut short after it stands:
    # see test_a_call_cut_short_after_its_name_stands)
    for model, script in (("qwen", "broken_early"), ("mistral", "mistral"),
                          ("pythonic", "pythonic")):
        cut = {"max_tokens": 8}  # the scripts' markup is cut short (finish: length)
        if script == "broken_early":
            cut = {}
        whole = await unary(client, model, script, tools=TOOLS, **cut)
        stream = await streamed(client, model, script, tools=TOOLS, **cut)
        assert whole["calls"] == stream["calls"] == []
        assert whole["content"] == stream["content"] and whole["content"]
        assert SCRIPTS[script].startswith(whole["content"])
        assert whole["finish"] == stream["finish"] == (
            "stop" if script == "broken_early" else "length")


@pytest.mark.parametrize(("model", "script", "content"), [
    ("qwen", "hermes", "Let me check."),
    ("llama", "llama", ""),
    ("mistral", "mistral", ""),
])
async def test_json_families_stream_the_arguments_in_pieces(client, model, script, content):
    """Each call's arguments arrive in several deltas as the engine writes them; they
    concatenate to the non-streamed arguments, exactly the model's text."""
    whole = await unary(client, model, script, raw=True, tools=TOOLS)
    assert whole["calls"] == BOTH and whole["content"] == content
    assert whole["raw"] == [json.dumps(W), json.dumps(T)]  # as the script wrote them
    stream = await streamed(client, model, script, tools=TOOLS)
    assert all(n > 1 for n in stream["pieces"]), stream["pieces"]
    assert same(stream, whole) == whole


async def test_pythonic_calls_go_out_whole(client):
    stream = await streamed(client, "pythonic", "pythonic", tools=TOOLS)
    assert stream["calls"] == BOTH and stream["pieces"] == [1, 1]


@pytest.mark.parametrize(("model", "script", "key", "content"), [
    ("qwen", "hermes", '"arguments": ', "Let me check."),
    ("llama", "llama", '"parameters": ', ""),
    ("mistral", "mistral", '"arguments": ', ""),
])
async def test_a_call_cut_short_by_max_tokens_streams_its_partial_arguments(
    client, tiny_model, model, script, key, content
):
    """Like OpenAI's API: the call stays as streamed, arguments truncated, finish ``length``."""
    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    ids = tokenizer.encode(SCRIPTS[script], add_special_tokens=False).ids
    limit = next(k for k in range(len(ids)) if '"city": "P' in tokenizer.decode(ids[:k]))
    text = tokenizer.decode(ids[:limit])
    partial = text[text.index(key) + len(key):]
    assert partial.startswith('{"city": "P') and partial != json.dumps(W)
    expected = {"content": content, "finish": "length", "reasoning": "",
                "calls": [("get_weather", partial)], "raw": [partial]}
    whole = await unary(client, model, script, raw=True, tools=TOOLS, max_tokens=limit)
    assert whole == expected
    stream = await streamed(client, model, script, tools=TOOLS, max_tokens=limit)
    assert same(stream, whole) == expected and stream["pieces"][0] > 1


async def test_a_call_cut_short_after_its_name_stands(client):
    """The output ends (end of sequence) inside a call's arguments: the call stands with its
    arguments so far, and the model made a call, so the finish reason is ``tool_calls``."""
    expected = {"content": "Sure", "finish": "tool_calls", "reasoning": "",
                "calls": [("get_weather", '{"city": ')], "raw": ['{"city": ']}
    assert await unary(client, "qwen", "broken", raw=True, tools=TOOLS) == expected
    stream = await streamed(client, "qwen", "broken", tools=TOOLS)
    assert same(stream, expected) == expected


async def test_required_and_named_tool_choice_on_an_engine_with_structured_outputs(client):
    for kwargs, calls in (
        ({"tool_choice": "required"}, [("get_weather", W)]),
        ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
         [("get_time", T)]),
    ):
        script = "required" if kwargs["tool_choice"] == "required" else "named"
        whole = await unary(client, "qwen", script, tools=TOOLS, **kwargs)
        assert whole == {"content": "", "finish": "tool_calls", "reasoning": "", "calls": calls}
        stream = await streamed(client, "qwen", script, tools=TOOLS, **kwargs)
        assert (stream["calls"], stream["content"], stream["finish"]) == (calls, "", "tool_calls")
    named = await streamed(client, "qwen", "named", tools=TOOLS,
                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named["deltas"] > 2  # the arguments stream as the engine writes them


async def test_required_is_refused_where_the_engine_lacks_structured_outputs(client):
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model="mocker", messages=ask("x"), tools=TOOLS, tool_choice="required")
    err = info.value.body
    assert err["param"] == "tool_choice" and "mocker" in err["message"]
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model="qwen", messages=ask("x"), tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}})
    assert info.value.body["param"] == "tool_choice"


@pytest.mark.parametrize(("model", "script", "reasoning", "content"), [
    ("r1", "r1", "Thinking it over.", "Paris is sunny."),
    ("qwen", "think", "\nPondering é 日本.\n", "\n\nThe answer is 4."),
    ("qwen", "default", "", "Hello there."),
])
async def test_reasoning_is_split_streaming_and_not(client, model, script, reasoning, content):
    whole = await unary(client, model, script)
    assert whole == {"content": content, "finish": "stop", "reasoning": reasoning, "calls": []}
    stream = await streamed(client, model, script)
    assert same(stream, whole) == whole


async def test_reasoning_then_tool_calls(client):
    whole = await unary(client, "qwen", "think_tools", tools=TOOLS)
    # text after </think> is content as it is (vLLM's parsers keep its leading newlines)
    assert whole == {"content": "\n\nLet me check.", "finish": "tool_calls",
                     "reasoning": "The user wants the weather.", "calls": BOTH}
    stream = await streamed(client, "qwen", "think_tools", tools=TOOLS)
    assert same(stream, whole) == whole


async def test_completions_are_not_parsed(client):
    resp = await client.completions.create(model="r1", prompt="script=r1", max_tokens=50)
    assert resp.choices[0].text == SCRIPTS["r1"]


async def test_every_choice_of_n_gets_its_reasoning_and_tool_calls(client):
    """``n = 2``: each sub-request's parsed reasoning and calls go to its own choice, streamed
    (each delta names its choice) and not."""
    resp = await client.chat.completions.create(
        model="qwen", messages=ask("think_tools"), tools=TOOLS, n=2)
    assert [c.index for c in resp.choices] == [0, 1]
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls"
        assert calls_of(choice.message) == BOTH
        assert choice.message.reasoning_content == "The user wants the weather."
        assert choice.message.content == "\n\nLet me check."
    stream = await client.chat.completions.create(
        model="qwen", messages=ask("think_tools"), tools=TOOLS, n=2, stream=True)
    calls: dict[int, dict[int, dict]] = {0: {}, 1: {}}
    reasoning = {0: "", 1: ""}
    finish = {}
    async for chunk in stream:
        choice = chunk.choices[0]
        reasoning[choice.index] += getattr(choice.delta, "reasoning_content", None) or ""
        for d in choice.delta.tool_calls or ():
            call = calls[choice.index].setdefault(d.index, {"name": d.function.name, "args": ""})
            call["args"] += d.function.arguments or ""
        if choice.finish_reason is not None:
            finish[choice.index] = choice.finish_reason
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    for index in (0, 1):
        assert reasoning[index] == "The user wants the weather."
        got = [(c["name"], json.loads(c["args"])) for _, c in sorted(calls[index].items())]
        assert got == BOTH
