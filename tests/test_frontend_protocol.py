"""Frontend errors and OpenAI request parsing: shapes, validation, unsupported options, fuzzing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamo_zmq import errors
from dynamo_zmq.frontend import errors as http
from dynamo_zmq.frontend.errors import HttpError
from dynamo_zmq.frontend.preprocess import Preprocessor
from dynamo_zmq.frontend.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_chat,
    parse_completion,
    prompts,
)
from dynamo_zmq.llm import build_card

MSGS = [{"role": "user", "content": "hi"}]


def chat_body(**fields: Any) -> bytes:
    return json.dumps({"model": "tiny", "messages": MSGS, **fields}).encode()


def completion_body(**fields: Any) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "hello", **fields}).encode()


def bad(fn: Any, body: bytes) -> HttpError:
    with pytest.raises(HttpError) as info:
        fn(body)
    assert info.value.status == 400
    return info.value


# -- errors ---------------------------------------------------------------------------------------


def test_error_json_is_openai_shape() -> None:
    err = http.bad_request("nope", param="temperature", code="invalid_value")
    assert msgspec.json.decode(err.to_json()) == {
        "error": {
            "message": "nope",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": "invalid_value",
        }
    }
    assert list(json.loads(http.timeout().to_json())["error"]) == [
        "message",
        "type",
        "param",
        "code",
    ]
    assert json.loads(http.engine_error().to_json())["error"]["param"] is None
    assert "status=400" in repr(err)


@pytest.mark.parametrize(
    ("err", "status", "code"),
    [
        (http.bad_request("x"), 400, None),
        (http.unsupported("echo"), 400, "unsupported_parameter"),
        (http.model_not_found("m"), 404, "model_not_found"),
        (http.not_found("/nope"), 404, "not_found"),
        (http.prompt_too_long("x"), 413, "context_length_exceeded"),
        (http.client_closed(), 499, "client_closed_request"),
        (http.no_worker(), 503, "service_unavailable"),
        (http.timeout(), 504, "timeout"),
        (http.engine_error(), 500, "internal_error"),
    ],
)
def test_error_helpers(err: HttpError, status: int, code: str | None) -> None:
    assert (err.status, err.code) == (status, code)
    assert err.message and err.type


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (errors.InvalidArgument("bad"), 400),
        (errors.CannotConnect("none"), 503),
        (errors.EngineShutdown("draining"), 503),
        (errors.Disconnected("gone"), 503),
        (errors.ConnectionTimeout("slow"), 504),
        (errors.ResponseTimeout("slow"), 504),
        (errors.Cancelled("stop"), 499),
        (errors.StreamIncomplete("gap"), 500),
        (errors.Unknown("boom"), 500),
    ],
)
def test_from_dynamo(exc: errors.DynamoError, status: int) -> None:
    err = http.from_dynamo(exc)
    assert err.status == status
    assert err.message == exc.message
    assert err.code == {"InvalidArgument": "invalid_argument"}.get(exc.kind, err.code)
    assert http.from_exception(exc).status == status


def test_from_exception() -> None:
    err = http.bad_request("x")
    assert http.from_exception(err) is err
    assert http.from_exception(RuntimeError("boom")).status == 500


# -- parsing --------------------------------------------------------------------------------------


def test_parse_chat_full() -> None:
    req = parse_chat(
        chat_body(
            messages=[
                {"role": "system", "content": "sys"},
                {"role": "user", "content": [{"type": "text", "text": "a"}], "name": "bob"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "content": "42", "tool_call_id": "c1"},
            ],
            max_completion_tokens=7,
            temperature=0,
            top_p=1,
            stream=True,
            stream_options={"include_usage": True},
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            tool_choice="auto",
            response_format={"type": "text"},
            logprobs=False,
            n=1,
            user="u",
            some_future_field={"x": 1},
        )
    )
    assert isinstance(req, ChatCompletionRequest)
    assert req.messages[1].content[0].text == "a"  # type: ignore[index,union-attr]
    assert req.messages[2].tool_calls[0].function.name == "f"  # type: ignore[index]
    assert req.stream_options is not None and req.stream_options.include_usage
    assert req.max_completion_tokens == 7 and req.temperature == 0.0


def test_unknown_fields_and_nulls_are_accepted() -> None:
    req = parse_chat(chat_body(stream=None, n=None, stop=None, ignore_eos=None, whatever=[1, 2]))
    assert req.n is None and req.stop is None
    assert parse_completion(completion_body(frobnicate=True)).prompt == "hello"


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("text", "text"),
        ("", ""),
        (["text"], "text"),
        ([1, 2, 3], [1, 2, 3]),
        ([[4, 5]], [4, 5]),
    ],
)
def test_completion_prompt_forms(prompt: Any, expected: Any) -> None:
    req = parse_completion(completion_body(prompt=prompt))
    assert isinstance(req, CompletionRequest)
    assert req.prompt == expected
    assert prompts(req) == [expected]


@pytest.mark.parametrize(
    "batch", [["a", "b"], [[1], [2, 3], [4]], ["a", [5, 6]], ["x"] * 128],
)
def test_completion_batches_of_prompts(batch: Any) -> None:
    """Several prompts (strings or token-id lists) in one call, up to 128, listed in order."""
    assert prompts(parse_completion(completion_body(prompt=batch))) == batch


@pytest.mark.parametrize(
    ("prompt", "words"),
    [
        (["a"] * 129, "batch of 129 prompts"),
        (["a", 1], "list of strings or of token-id lists"),
        ([[1], [-2]], "negative token id"),
        ([[1], []], "must not be empty"),
        ([[1], [2, "a"]], "Expected"),
        ([], "must not be empty"),
        ([[]], "must not be empty"),
        ([1, "a"], "list of token ids"),
        ([1, [2]], "list of token ids"),
        ([1, -2], "negative token id"),
        ([1.5], "Expected"),
        ({"a": 1}, "Expected"),
        (None, "Expected"),
    ],
)
def test_completion_bad_prompts(prompt: Any, words: str) -> None:
    err = bad(parse_completion, completion_body(prompt=prompt))
    assert words in err.message
    assert err.param is not None and err.param.startswith("prompt")


def test_malformed_json_and_missing_fields() -> None:
    assert "not valid JSON" in bad(parse_chat, b'{"model": "x", ').message
    assert "not valid JSON" in bad(parse_chat, b"\xff\xfe").message
    assert "not valid JSON" in bad(parse_completion, b"").message
    assert bad(parse_chat, b'{"messages": []}').param == "model"
    assert bad(parse_chat, b'{"model": "x"}').param == "messages"
    assert bad(parse_completion, b'{"model": "x"}').param == "prompt"
    assert bad(parse_chat, b"[1, 2]").param is None
    err = bad(parse_chat, chat_body(messages=[{"content": "no role"}]))
    assert err.code == "missing_required_parameter" and err.param == "messages[0]"
    deep = b'{"model": "x", "messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    bad(parse_chat, deep)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "hot"),
        ("temperature", True),
        ("max_tokens", 1.5),
        ("max_tokens", "10"),
        ("n", True),
        ("stop", 3),
        ("stop", [1]),
        ("stream", "yes"),
        ("seed", 0.5),
        ("top_k", 1.5),
        ("stop_token_ids", ["a"]),
        ("messages", "hello"),
        ("messages", [{"role": 1, "content": "x"}]),
        ("messages", [{"role": "user", "content": 5}]),
        ("messages", [{"role": "user", "content": [{"text": "x"}]}]),
        ("tools", [{"type": "function"}]),
        ("chat_template_kwargs", [1]),
    ],
)
def test_wrong_types_name_the_field(field: str, value: Any) -> None:
    err = bad(parse_chat, chat_body(**{field: value}))
    assert err.param is not None and err.param.startswith(field)
    assert field in err.message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", 2.01),
        ("top_p", 0),
        ("top_p", 1.5),
        ("min_p", -0.5),
        ("min_p", 1.5),
        ("n", 0),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_completion_tokens", 0),
        ("min_tokens", -1),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.5),
        ("frequency_penalty", 3),
        ("repetition_penalty", 0),
        ("repetition_penalty", 2.5),
        ("top_k", -2),
        ("seed", 2**64),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop_token_ids", [-1]),
        ("max_tokens", 2**70),
    ],
)
def test_out_of_range_values(field: str, value: Any) -> None:
    for fn, body in ((parse_chat, chat_body), (parse_completion, completion_body)):
        if field == "max_completion_tokens" and fn is parse_completion:
            continue
        err = bad(fn, body(**{field: value}))
        assert err.param == field
        assert field in err.message


def test_in_range_edges_are_accepted() -> None:
    req = parse_chat(
        chat_body(
            temperature=2,
            top_p=1,
            min_p=0,
            presence_penalty=-2,
            frequency_penalty=2,
            repetition_penalty=2,
            top_k=-1,
            seed=-(2**63),
            min_tokens=3,
            max_tokens=3,
        )
    )
    assert req.top_k == -1
    assert parse_chat(chat_body(top_k=0)).top_k == 0


def test_cross_field_rules() -> None:
    assert "min_tokens" in bad(parse_chat, chat_body(min_tokens=5, max_tokens=4)).message
    assert bad(parse_chat, chat_body(min_tokens=5, max_completion_tokens=4)).param == "min_tokens"
    assert bad(parse_chat, chat_body(stream_options={"include_usage": True})).param == (
        "stream_options"
    )
    assert bad(parse_chat, chat_body(messages=[])).param == "messages"
    err = bad(parse_chat, chat_body(continue_final_message=True))
    assert err.param == "continue_final_message"
    assert bad(parse_chat, chat_body(tool_choice="sometimes")).param == "tool_choice"


def test_tool_choice_required_and_named() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    named = {"type": "function", "function": {"name": "f"}}
    assert parse_chat(chat_body(tools=tools, tool_choice="required")).tool_choice == "required"
    assert parse_chat(chat_body(tools=tools, tool_choice=named)).tool_choice == named
    for choice in ("required", named):  # nothing to call
        assert bad(parse_chat, chat_body(tool_choice=choice)).param == "tool_choice"
    for choice in ({"type": "function", "function": {"name": "g"}}, {"type": "function"},
                   {"name": "f"}):
        assert bad(parse_chat, chat_body(tools=tools, tool_choice=choice)).param == "tool_choice"


CHAT_UNSUPPORTED = [
    ("echo", True),
    ("chat_template", "{{ messages }}"),
    ("modalities", ["text", "audio"]),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("prediction", {"type": "content", "content": "x"}),
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
    ("use_beam_search", True),
    ("prompt_logprobs", 1),
    ("spaces_between_special_tokens", False),
]
COMPLETION_UNSUPPORTED = [
    ("suffix", "end"),
    ("use_beam_search", True),
]


@pytest.mark.parametrize(("field", "value"), CHAT_UNSUPPORTED)
def test_chat_unsupported_options(field: str, value: Any) -> None:
    err = bad(parse_chat, chat_body(**{field: value}))
    assert err.code == "unsupported_parameter"
    assert err.param == field
    assert f"'{field}' is not supported yet" in err.message


@pytest.mark.parametrize(("field", "value"), COMPLETION_UNSUPPORTED)
def test_completion_unsupported_options(field: str, value: Any) -> None:
    err = bad(parse_completion, completion_body(**{field: value}))
    assert err.code == "unsupported_parameter"
    assert err.param == field
    assert f"'{field}' is not supported yet" in err.message


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"n": 129}, "n", "at most 128"),
        ({"n": 0}, "n", "at least 1"),
        ({"n": 3, "best_of": 2}, "best_of", "at least 'n'"),
        ({"best_of": 129}, "best_of", "at most 128"),
        ({"best_of": 3, "stream": True}, "best_of", "cannot be streamed"),
        ({"prompt": ["a"] * 5, "best_of": 128}, "prompt", "more than the 512"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"-1": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"1_0": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "between -100 and 100"),
        ({"logit_bias": {"5": -100.5}}, "logit_bias", "between -100 and 100"),
    ],
)
def test_choices_and_logit_bias_are_bounded(fields: dict[str, Any], param: str,
                                            words: str) -> None:
    """``n``/``best_of`` bounded, ``best_of >= n`` and not streamed past ``n``; ``logit_bias``
    maps token ids to [-100, 100]: 400 naming the parameter."""
    err = bad(parse_completion, completion_body(**fields))
    assert err.param == param and words in err.message, err.message
    if "prompt" not in fields and "best_of" not in fields:
        assert bad(parse_chat, chat_body(**fields)).param == param


def test_choices_echo_and_logit_bias_are_accepted() -> None:
    req = parse_completion(completion_body(
        n=3, best_of=5, echo=True, logit_bias={"5": 100, "7": -100.0}, seed=1
    ))
    assert (req.n, req.best_of, req.echo, req.logit_bias) == (3, 5, True, {"5": 100, "7": -100})
    assert parse_chat(chat_body(n=128, stream=True, logit_bias={"0": 0.5})).n == 128
    parse_completion(completion_body(n=2, best_of=2, stream=True))


def test_unsupported_content_and_tools() -> None:
    audio = {"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}}
    err = bad(parse_chat, chat_body(messages=[{"role": "user", "content": [audio]}]))
    assert err.code == "unsupported_parameter" and "input_audio" in err.message
    assert err.param == "messages[0].content[0]"
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    parse_chat(chat_body(messages=[{"role": "user", "content": [image]}]))  # images: in user's
    err = bad(parse_chat, chat_body(messages=[{"role": "assistant", "content": [image]}]))
    assert "only allowed in user messages" in err.message
    assert err.param == "messages[0].content[0]"
    err = bad(parse_chat, chat_body(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]))
    assert err.param == "messages[0].content[0].image_url.url"
    err = bad(parse_chat, chat_body(messages=[{"role": "user", "content": [{"type": "text"}]}]))
    assert "text" in err.message
    err = bad(parse_chat, chat_body(tools=[{"type": "web", "function": {"name": "f"}}]))
    assert err.code == "unsupported_parameter"


def test_supported_defaults_pass() -> None:
    body = chat_body(
        n=1,
        logprobs=False,
        top_logprobs=0,
        echo=False,
        logit_bias={},
        response_format={"type": "text"},
        tool_choice="none",
        modalities=["text"],
    )
    parse_chat(body)
    parse_completion(completion_body(n=1, best_of=1, echo=False, logprobs=None, logit_bias=None))


def test_logprobs_ranges() -> None:
    """Issue 15: logprobs are accepted (chat top_logprobs 0..20 with logprobs; completions
    logprobs 0..5); out of range, or top_logprobs without logprobs, is a 400 naming it."""
    assert parse_chat(chat_body(logprobs=True)).logprobs is True
    assert parse_chat(chat_body(logprobs=True, top_logprobs=20)).top_logprobs == 20
    assert parse_completion(completion_body(logprobs=5)).logprobs == 5
    assert parse_completion(completion_body(logprobs=0)).logprobs == 0
    for body, param in ((chat_body(logprobs=True, top_logprobs=21), "top_logprobs"),
                        (chat_body(logprobs=True, top_logprobs=-1), "top_logprobs"),
                        (chat_body(top_logprobs=1), "top_logprobs"),
                        (chat_body(logprobs=False, top_logprobs=3), "top_logprobs")):
        assert bad(parse_chat, body).param == param
    for value in (6, -1):
        assert bad(parse_completion, completion_body(logprobs=value)).param == "logprobs"


# -- fuzzing: only ever HttpError 400/413 ---------------------------------------------------------

CHAT_KEYS = [f.name for f in msgspec.structs.fields(ChatCompletionRequest)]
COMPLETION_KEYS = [f.name for f in msgspec.structs.fields(CompletionRequest)]

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
_json = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "bogus"]) | _json},
    optional={
        "content": st.text(max_size=30)
        | st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "image_url"]) | _json},
                optional={"text": st.text(max_size=10) | _json},
            ),
            max_size=3,
        )
        | _json,
        "name": _json,
        "tool_calls": _json,
        "tool_call_id": _json,
    },
)


_text_part = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)})
_good_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool", "bogus"]),
        "content": st.none() | st.text(max_size=80) | st.lists(_text_part, max_size=3),
    }
)
_tool = st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.text(max_size=8)})}
)
_tokens = st.lists(st.integers(min_value=0, max_value=600), max_size=80)
#: Mostly valid values, so that many bodies parse and reach the preprocessor.
_GOOD = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 2),
    "max_tokens": st.integers(1, 100),
    "min_tokens": st.integers(0, 10),
    "stop": st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 600), max_size=3),
    "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "add_special_tokens": st.booleans(),
    "stream": st.booleans(),
    "user": st.text(max_size=5),
}
_GOOD_CHAT = {
    **_GOOD,
    "messages": st.lists(_good_message, min_size=1, max_size=4),
    "max_completion_tokens": st.integers(1, 100),
    "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(),
    "chat_template_kwargs": st.dictionaries(st.text(max_size=8), _json, max_size=3),
    "tools": st.lists(_tool, max_size=2),
    "tool_choice": st.sampled_from(["none", "auto"]),
}
_GOOD_COMPLETION = {
    **_GOOD,
    "prompt": st.text(max_size=200)
    | _tokens
    | st.lists(st.text(max_size=50), min_size=1, max_size=1)
    | st.lists(_tokens, min_size=1, max_size=1),
}


def _bodies(
    keys: list[str], base: dict[str, Any], good: dict[str, Any]
) -> st.SearchStrategy[bytes]:
    field_values = st.dictionaries(
        st.sampled_from(keys) | st.text(max_size=8),
        _json
        | st.lists(_message, min_size=1, max_size=3)
        | st.integers(min_value=0, max_value=4000),
        max_size=6,
    )
    random_fields = field_values.map(lambda extra: {**base, **extra})
    good_fields = st.fixed_dictionaries({}, optional=good).map(lambda extra: {**base, **extra})
    as_json = (good_fields | random_fields | _json).map(lambda v: json.dumps(v).encode())
    truncated = st.tuples(as_json, st.integers(min_value=0, max_value=200)).map(
        lambda t: t[0][: t[1]]
    )
    return as_json | truncated | st.binary(max_size=64)


@pytest.fixture(scope="module")
def fuzz_pre(tiny_model: Path) -> Preprocessor:
    return Preprocessor(tiny_model, build_card(tiny_model, "tiny", context_length=64))


_FUZZ = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@_FUZZ
@given(body=_bodies(CHAT_KEYS, {"model": "tiny", "messages": MSGS}, _GOOD_CHAT))
def test_fuzz_chat_only_raises_http_errors(fuzz_pre: Preprocessor, body: bytes) -> None:
    try:
        req = parse_chat(body)
        fuzz_pre.chat(req)
    except HttpError as exc:
        assert exc.status in (400, 413)
        json.loads(exc.to_json())


@_FUZZ
@given(body=_bodies(COMPLETION_KEYS, {"model": "tiny", "prompt": "hello"}, _GOOD_COMPLETION))
def test_fuzz_completion_only_raises_http_errors(fuzz_pre: Preprocessor, body: bytes) -> None:
    try:
        req = parse_completion(body)
        fuzz_pre.completion(req)
    except HttpError as exc:
        assert exc.status in (400, 413)
        json.loads(exc.to_json())
