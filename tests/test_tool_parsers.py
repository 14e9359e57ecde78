"""The tool-call and reasoning parsers on their own: every family's markup, several calls,
invalid and unfinished markup (content, never lost, until a call's name went out: then the call
stands with its arguments as far as they went), the JSON families' arguments streaming as
written, and the property that any split of the text into deltas gives what the whole text
gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_zmq.llm import FinishReason, LLMEngineOutput, PreprocessedRequest, ToolOptions
from dynamo_zmq.llm.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    NamedToolParser,
    RequiredToolParser,
    ToolParser,
    detect_parsers,
    output_parser,
)

W = {"city": "Paris", "days": 3}
T = {"tz": "Europe/Paris"}

#: (parser, text, content, [(name, arguments)]) per family; arguments as objects.
CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris", "days": 3}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
     '"arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
     "Let me check.", [("get_weather", W), ("get_time", T)]),
    ("hermes", "No tools needed: 1 < 2 and <tool_ is not a tag.", "No tools needed: 1 < 2 and "
     "<tool_ is not a tag.", []),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}',
     "", [("get_time", T)]),  # no closing tag at the end of the output
    ("hermes", 'A <tool_call>{"name": 5}</tool_call> B', 'A <tool_call>{"name": 5}</tool_call> B',
     []),
    ("hermes", 'ok <tool_call>{"name": "get_weather", "argu', "ok", [("get_weather", "")]),
    ("hermes", 'ok <tool_call>{"name": "get_wea', 'ok <tool_call>{"name": "get_wea', []),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Par', "",
     [("get_weather", '{"city": "Par')]),  # cut short in the arguments: the call stands
    ("hermes", '<tool_call>{"arguments": {"tz": "Europe/Paris"}, "name": "get_time"}'
     "</tool_call>", "", [("get_time", T)]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"Europe/Paris\\"}"}'
     "</tool_call>", "", [("get_time", T)]),  # the arguments as a JSON string
    ("hermes", '<tool_call>{"name": "q", "arguments": {"s": "a \\"}]\\" b\\\\", '
     '"n": [1, {"x": "]"}]}}</tool_call>', "",
     [("q", {"s": 'a "}]" b\\', "n": [1, {"x": "]"}]})]),  # brackets and escapes in strings
    ("hermes", '<tool_call>{"name":"f","arguments":{ "a" :1 }}</tool_call>', "",
     [("f", '{ "a" :1 }')]),  # the arguments exactly as written
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', "",
     [("get_weather", W)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
     '"days": 3}}; {"name": "get_time", "parameters": {"tz": "Europe/Paris"}}', "",
     [("get_weather", W), ("get_time", T)]),
    ("llama3_json", "The answer is {not json}.", "The answer is {not json}.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": ', "",
     [("get_weather", '{"city": ')]),
    ("llama3_json", '  {"weather": "sunny"}', '  {"weather": "sunny"}', []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},'
     ' {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]', "",
     [("get_weather", W), ("get_time", T)]),
    ("mistral", 'Checking [TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]',
     "Checking", [("get_time", T)]),
    ("mistral", "[TOOL_CALLS] nothing", "[TOOL_CALLS] nothing", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}, '
     '{"name": "get_weather", "arguments": {"city"', "",
     [("get_time", T), ("get_weather", '{"city"')]),
    ("pythonic", '[get_weather(city="Paris", days=3), get_time(tz=\'Europe/Paris\')]', "",
     [("get_weather", W), ("get_time", T)]),
    ("pythonic", "[1] says so, see [get_time()]", "[1] says so, see [get_time()]", []),
    ("pythonic", '[get_weather(city="Par', '[get_weather(city="Par', []),
    ("pythonic", "[get_time(tz=open('x'))]", "[get_time(tz=open('x'))]", []),
]


def run(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Content and calls ``(name, arguments as streamed)`` of ``pieces`` fed in turn."""
    content: list[str] = []
    deltas = []
    for piece in pieces:
        text, calls = parser.feed(piece)
        content.append(text)
        deltas += calls
    text, calls = parser.finish()
    content.append(text)
    deltas += calls
    return "".join(content), assemble(deltas)


def assemble(deltas) -> list[tuple[str, str]]:
    calls: dict[int, list] = {}
    for d in deltas:
        if d.id is not None:
            assert d.index not in calls and d.name and not d.arguments
            calls[d.index] = [d.name, ""]
        else:
            assert d.arguments  # no empty pieces
        calls[d.index][1] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return [(calls[i][0], calls[i][1]) for i in range(len(calls))]


def expected(got: list[tuple[str, str]], want: list[tuple[str, dict | str]]) -> bool:
    """``got`` calls are ``want``: arguments given as an object parse to it (a JSON object),
    given as a string are exactly it."""
    if [n for n, _ in got] != [n for n, _ in want]:
        return False
    return all(raw == args if isinstance(args, str) else json.loads(raw) == args
               for (_, raw), (_, args) in zip(got, want, strict=True))


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_whole_text(name, text, content, calls) -> None:
    got, found = run(TOOL_PARSERS[name](), [text])
    assert got == content and expected(found, calls), (got, found)


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_one_character_at_a_time(name, text, content, calls) -> None:
    assert run(TOOL_PARSERS[name](), list(text)) == run(TOOL_PARSERS[name](), [text])


def splits(text: str):
    return st.lists(st.integers(0, len(text)), max_size=12).map(
        lambda cuts: [text[a:b] for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(text)],
                                                strict=True)]
    )


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_split_gives_the_whole_texts_result(data) -> None:
    name, text, _, _ = data.draw(st.sampled_from(CASES))
    # the text, possibly cut short (unfinished markup) and with text around it
    text = data.draw(st.sampled_from(["", "Hi ", " \n"])) + text
    text = text[: data.draw(st.integers(0, len(text)))] + data.draw(st.sampled_from(["", " end"]))
    pieces = data.draw(splits(text))
    whole = run(TOOL_PARSERS[name](), [text])
    assert run(TOOL_PARSERS[name](), pieces) == whole
    got, found = whole
    if not found:  # no call: nothing is lost
        assert got == text


def test_json_arguments_stream_as_the_model_writes_them() -> None:
    """The first delta once the name is complete, then each piece of the arguments object as
    it arrives, nothing held back; arguments before the name wait for it."""
    for name, head, args_key, tail in (
        ("hermes", "<tool_call>\n", "arguments", "}\n</tool_call>"),
        ("llama3_json", "<|python_tag|>", "parameters", "}"),
        ("mistral", "[TOOL_CALLS] [", "arguments", "}]"),
    ):
        parser = TOOL_PARSERS[name]()
        assert parser.feed(head + '{"name": "get_wea') == ("", [])
        _, (first,) = parser.feed('ther", ')
        assert (first.index, first.name, first.arguments) == (0, "get_weather", "")
        assert first.id is not None and first.id.startswith("call_")
        pieces = [f'"{args_key}": ', '{"ci', 'ty": "Pa', 'ris\\"', '", "days": 3', "}", tail]
        got = [parser.feed(p) for p in pieces] + [parser.finish()]
        assert [c for c, _ in got] == [""] * len(got)
        assert [[(d.index, d.id, d.arguments) for d in ds] for _, ds in got] == [
            [], [(0, None, '{"ci')], [(0, None, 'ty": "Pa')], [(0, None, 'ris\\"')],
            [(0, None, '", "days": 3')], [(0, None, "}")], [], []]
    parser = TOOL_PARSERS["hermes"]()
    assert parser.feed('<tool_call>{"arguments": {"tz": "UTC"}, ') == ("", [])
    _, deltas = parser.feed('"name": "get_time"')
    assert [(d.name, d.arguments) for d in deltas] == [("get_time", ""), (None, '{"tz": "UTC"}')]


#: The cases whose calls are all complete.
COMPLETE = [c for c in CASES if all(not isinstance(args, str) or args.endswith("}")
                                    for _, args in c[3])]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_complete_calls_any_split_gives_the_same_calls_and_content(data) -> None:
    name, text, content, calls = data.draw(st.sampled_from(COMPLETE))
    got, found = run(TOOL_PARSERS[name](), data.draw(splits(text)))
    assert got == content and expected(found, calls)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_cut_short_stream_is_a_prefix_of_the_whole(data) -> None:
    """Cut anywhere, the calls so far are the whole text's first calls, each with a prefix of
    its arguments: what streamed never has to be taken back."""
    name, text, _, _ = data.draw(st.sampled_from(COMPLETE))
    _, whole = run(TOOL_PARSERS[name](), [text])
    cut = text[: data.draw(st.integers(0, len(text)))]
    _, found = run(TOOL_PARSERS[name](), data.draw(splits(cut)))
    assert len(found) <= len(whole)
    for (n, args), (full_n, full_args) in zip(found, whole, strict=False):
        assert n == full_n and full_args.startswith(args)


def test_streamed_content_holds_back_only_possible_markup() -> None:
    parser = TOOL_PARSERS["hermes"]()
    assert parser.feed("Hello wor") == ("Hello wor", [])
    assert parser.feed("ld <tool") == ("ld", [])
    content, calls = parser.feed('_call>{"name": "f", "arguments": {}}</tool_call>')
    assert content == "" and [(c.index, c.name) for c in calls] == [(0, "f"), (0, None)]


def test_required_and_named_parse_the_constrained_json() -> None:
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}]'
    for pieces in ([text], list(text)):
        got, found = run(RequiredToolParser(), pieces)
        assert got == "" and expected(found, [("get_weather", W)])
    parser = NamedToolParser("get_time")
    _, deltas = parser.feed('{"tz": ')
    assert deltas[0].name == "get_time" and deltas[1].arguments == '{"tz": '
    assert run(NamedToolParser("get_time"), list(json.dumps(T))) == ("", [("get_time",
                                                                         json.dumps(T))])


REASONING = [
    ("deepseek_r1", "Think hard.</think>The answer.", "Think hard.", "The answer."),
    ("deepseek_r1", "<think>Think hard.</think>The answer.", "Think hard.", "The answer."),
    ("deepseek_r1", "Still thinking <", "Still thinking <", ""),
    ("qwen3", "<think>\nHmm.\n</think>\n\nDone.", "\nHmm.\n", "\n\nDone."),
    ("qwen3", "No thinking here </think>", "", "No thinking here </think>"),
    ("qwen3", "<thin", "", "<thin"),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), REASONING)
def test_reasoning(name, text, reasoning, content) -> None:
    for pieces in ([text], list(text)):
        parser = REASONING_PARSERS[name]()
        got = [parser.feed(p) for p in pieces] + [parser.finish()]
        assert ("".join(r for r, _ in got), "".join(c for _, c in got)) == (reasoning, content)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_reasoning_any_split(data) -> None:
    name, text, _, _ = data.draw(st.sampled_from(REASONING))
    text = text[: data.draw(st.integers(0, len(text)))]
    results = []
    for pieces in ([text], data.draw(splits(text))):
        parser = REASONING_PARSERS[name]()
        got = [parser.feed(p) for p in pieces] + [parser.finish()]
        results.append(("".join(r for r, _ in got), "".join(c for _, c in got)))
    assert results[0] == results[1]


def test_reasoning_then_tools_and_the_finish_reason() -> None:
    request = PreprocessedRequest([1], tools=ToolOptions(), reasoning=True)
    parser = output_parser(request, "hermes", "qwen3")
    assert parser is not None
    text = '<think>Weather?</think>\n<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    outs = [parser.apply(LLMEngineOutput([1], text=c)) for c in text[:-3]]
    last = parser.apply(LLMEngineOutput([2], text=text[-3:], finish_reason=FinishReason.EOS))
    assert "".join(o.reasoning or "" for o in [*outs, last]) == "Weather?"
    assert "".join(o.text or "" for o in [*outs, last]) == ""
    # the call streamed before the last chunk (its arguments were complete by then)
    assert last.finish_reason == FinishReason.TOOL_CALLS
    streamed = [c for o in outs for c in o.tool_calls or ()]
    assert [c.name for c in streamed if c.name] == ["f"]
    assert "".join(c.arguments for c in streamed) == "{}"
    # no tools or tool_choice none (the frontend sends no ToolOptions), no reasoning: no parser
    assert output_parser(PreprocessedRequest([1]), "hermes", "qwen3") is None
    # required: the constrained JSON starts at the first token, so no reasoning is looked for
    required = PreprocessedRequest([1], tools=ToolOptions("required"), reasoning=True)
    parser = output_parser(required, "hermes", "deepseek_r1")
    assert parser is not None and parser.reasoning is None
    assert isinstance(parser.tools, RequiredToolParser)


def test_detect_from_the_chat_template(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% if tools %}<tool_call>{% endif %}<think>\n</think>"}))
    assert detect_parsers(tmp_path) == ("hermes", "qwen3")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "plain"}))
    assert detect_parsers(tmp_path) == (None, None)


_FRAGMENTS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "[", "]", "{", "}",
              "(", ")", '"', "'", "\\", ",", ";", " ", "\n", "name", '"name": "f"', ":",
              '"arguments": {}', '"parameters": {"a": 1}', "f(a=1)", "x", "é",
              '{"name": "g", "arguments": {"s": "', '"arguments": {"n": [1, "]', "true", "3"]


def subsequence(part: str, text: str) -> bool:
    chars = iter(text)
    return all(c in chars for c in part)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sorted(TOOL_PARSERS)), st.lists(st.sampled_from(_FRAGMENTS), max_size=30),
       st.data())
def test_any_markup_soup_never_crashes_or_loses_text(name, fragments, data) -> None:
    text = "".join(fragments)
    whole = run(TOOL_PARSERS[name](), [text])
    assert run(TOOL_PARSERS[name](), data.draw(splits(text))) == whole
    if not whole[1]:
        assert whole[0] == text
    assert subsequence(whole[0], text)  # content is the text less the calls' markup
