"""Preprocessor: chat templates, tokenization, options into PreprocessedRequest, context limits."""

from __future__ import annotations

import json
import shutil
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from dynamo_zmq.frontend.errors import HttpError
from dynamo_zmq.frontend.preprocess import Preprocessor
from dynamo_zmq.frontend.protocol import parse_chat, parse_completion
from dynamo_zmq.llm import PreprocessedRequest, build_card
from dynamo_zmq.tools.tiny_model import BOS, CHAT_TEMPLATE, EOS

CTX = 256
CONVERSATION = [
    {"role": "system", "content": "You are a helpful model."},
    {"role": "user", "content": "What is the first number?"},
    {"role": "assistant", "content": "It is one."},
    {"role": "user", "content": "And the second?"},
]


@pytest.fixture(scope="module")
def pre(tiny_model: Path) -> Preprocessor:
    return Preprocessor(tiny_model, build_card(tiny_model, "tiny", context_length=CTX))


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


def chat(pre: Preprocessor, **fields: Any) -> PreprocessedRequest:
    body = {"model": "tiny", "messages": CONVERSATION, **fields}
    return pre.chat(parse_chat(json.dumps(body).encode()))


def completion(pre: Preprocessor, **fields: Any) -> PreprocessedRequest:
    body = {"model": "tiny", "prompt": "hello world", **fields}
    return pre.completion(parse_completion(json.dumps(body).encode()))


def reference_render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    """The tiny model's template rendered independently, the way transformers renders it."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(CHAT_TEMPLATE).render(
        messages=messages, bos_token=BOS, eos_token=EOS, add_generation_prompt=add_generation_prompt
    )


def error(fn: Any, *args: Any, **kwargs: Any) -> HttpError:
    with pytest.raises(HttpError) as info:
        fn(*args, **kwargs)
    return info.value


# -- model facts ----------------------------------------------------------------------------------


def test_model_facts(pre: Preprocessor, tok: Tokenizer, tiny_model: Path) -> None:
    assert pre.bos_token == BOS and pre.eos_token == EOS
    assert pre.eos_token_ids == [tok.token_to_id(EOS)]
    assert pre.context_length == CTX
    assert pre.tokenizer.get_vocab_size() == tok.get_vocab_size()
    assert pre.vocab_size == json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    # Without a context length on the card, config.json's max_position_embeddings bounds it.
    assert Preprocessor(tiny_model, build_card(tiny_model, "tiny")).context_length == 2048


# -- chat -----------------------------------------------------------------------------------------


def test_chat_multiturn_matches_template(pre: Preprocessor, tok: Tokenizer) -> None:
    expected = reference_render(CONVERSATION, add_generation_prompt=True)
    assert expected.startswith(BOS + "<|system|>\nYou are a helpful model." + EOS)
    assert expected.endswith("<|assistant|>\n")
    req = parse_chat(json.dumps({"model": "tiny", "messages": CONVERSATION}).encode())
    assert pre.render(req) == expected
    out = pre.chat(req)
    assert out.token_ids == tok.encode(expected, add_special_tokens=False).ids
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    assert out.token_ids[0] == bos and out.token_ids.count(bos) == 1  # the template's BOS only
    assert out.token_ids.count(eos) == len(CONVERSATION)
    assert out.model == "tiny" and out.eos_token_ids == [eos]


def test_add_generation_prompt(pre: Preprocessor, tok: Tokenizer) -> None:
    expected = reference_render(CONVERSATION, add_generation_prompt=False)
    assert not expected.endswith("<|assistant|>\n")
    out = chat(pre, add_generation_prompt=False)
    assert out.token_ids == tok.encode(expected, add_special_tokens=False).ids
    with_prompt = chat(pre, add_generation_prompt=True).token_ids
    assert with_prompt[: len(out.token_ids)] == out.token_ids
    assert len(with_prompt) > len(out.token_ids)


def test_content_parts_join_with_newlines(pre: Preprocessor) -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    as_parts = chat(pre, messages=[{"role": "user", "content": parts}])
    as_text = chat(pre, messages=[{"role": "user", "content": "first\nsecond"}])
    assert as_parts.token_ids == as_text.token_ids
    assert chat(pre, messages=[{"role": "user", "content": None}]).token_ids == (
        chat(pre, messages=[{"role": "user", "content": ""}]).token_ids
    )


def test_add_special_tokens_for_chat(pre: Preprocessor, tok: Tokenizer) -> None:
    plain = chat(pre).token_ids
    doubled = chat(pre, add_special_tokens=True).token_ids
    assert doubled == [tok.token_to_id(BOS), *plain]


def test_template_error_is_400(pre: Preprocessor) -> None:
    err = error(chat, pre, messages=[{"role": "wizard", "content": "hi"}])
    assert err.status == 400 and "Unknown role: wizard" in err.message


def test_continue_final_message(pre: Preprocessor, tok: Tokenizer) -> None:
    messages = [*CONVERSATION, {"role": "assistant", "content": "The second is"}]
    out = chat(pre, messages=messages, add_generation_prompt=False, continue_final_message=True)
    full = reference_render(messages, add_generation_prompt=False)
    expected = full[: full.rindex("The second is") + len("The second is")]
    assert out.token_ids == tok.encode(expected, add_special_tokens=False).ids


# -- completions ----------------------------------------------------------------------------------


def test_completion_text_adds_special_tokens(pre: Preprocessor, tok: Tokenizer) -> None:
    out = completion(pre, prompt="The first number is")
    assert out.token_ids == tok.encode("The first number is").ids
    assert out.token_ids[0] == tok.token_to_id(BOS)
    bare = completion(pre, prompt="The first number is", add_special_tokens=False)
    assert bare.token_ids == out.token_ids[1:]
    assert completion(pre, prompt=["The first number is"]).token_ids == out.token_ids


def test_completion_token_prompt(pre: Preprocessor) -> None:
    assert completion(pre, prompt=[1, 50, 60, 70]).token_ids == [1, 50, 60, 70]
    assert completion(pre, prompt=[[5, 6]]).token_ids == [5, 6]
    err = error(completion, pre, prompt=[1, pre.vocab_size])
    assert err.status == 400 and str(pre.vocab_size) in err.message


def test_empty_tokenization_is_400(pre: Preprocessor) -> None:
    err = error(completion, pre, prompt="", add_special_tokens=False)
    assert err.status == 400 and err.param == "prompt"
    assert completion(pre, prompt="").token_ids == [pre.tokenizer.token_to_id(BOS)]


# -- options --------------------------------------------------------------------------------------

ALL_OPTIONS: dict[str, Any] = {
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 40,
    "min_p": 0.05,
    "seed": 1234,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "repetition_penalty": 1.1,
    "n": 1,
    "max_tokens": 20,
    "min_tokens": 3,
    "stop": ["END", "STOP"],
    "stop_token_ids": [7, 8],
    "ignore_eos": True,
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
}


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_every_option_lands(pre: Preprocessor, kind: str) -> None:
    out = (chat if kind == "chat" else completion)(pre, **ALL_OPTIONS)
    s, stop = out.sampling, out.stop
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.7, 0.9, 40, 0.05, 1234)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.5, 1.1)
    assert s.n == 1
    assert (stop.max_tokens, stop.min_tokens) == (20, 3)
    assert stop.stop == ["END", "STOP"] and stop.stop_token_ids == [7, 8]
    assert stop.ignore_eos and stop.include_stop_str_in_output
    assert out.output.skip_special_tokens is False
    assert out.eos_token_ids == pre.eos_token_ids and out.model == "tiny"


def test_defaults(pre: Preprocessor) -> None:
    out = completion(pre, max_tokens=5)
    s, stop = out.sampling, out.stop
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (None,) * 5
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.n) == (
        None,
        None,
        None,
        1,
    )
    assert (stop.min_tokens, stop.stop, stop.stop_token_ids) == (0, [], [])
    assert not stop.ignore_eos and not stop.include_stop_str_in_output
    assert out.output.skip_special_tokens is True
    assert completion(pre, stop="x").stop.stop == ["x"]


def test_max_tokens_defaults_to_rest_of_context(pre: Preprocessor, tiny_model: Path) -> None:
    out = chat(pre)
    assert out.stop.max_tokens == CTX - len(out.token_ids)
    out = completion(pre)
    assert out.stop.max_tokens == CTX - len(out.token_ids)
    wide = Preprocessor(tiny_model, build_card(tiny_model, "tiny"))
    out = wide.completion(parse_completion(b'{"model": "tiny", "prompt": "hi"}'))
    assert out.stop.max_tokens == 2048 - len(out.token_ids)


def test_max_completion_tokens_wins(pre: Preprocessor) -> None:
    assert chat(pre, max_tokens=10, max_completion_tokens=4).stop.max_tokens == 4
    assert chat(pre, max_tokens=10).stop.max_tokens == 10


# -- context length (413) -------------------------------------------------------------------------


def test_prompt_at_context_length_is_413(pre: Preprocessor) -> None:
    err = error(completion, pre, prompt=[5] * CTX)
    assert (err.status, err.code, err.param) == (413, "context_length_exceeded", "prompt")
    assert f"{CTX} tokens" in err.message and f"{CTX} input tokens" in err.message
    long_text = "the " * (CTX * 2)
    err = error(chat, pre, messages=[{"role": "user", "content": long_text}])
    assert (err.status, err.param) == (413, "messages")
    assert "maximum context length is 256 tokens" in err.message
    json.loads(err.to_json())


def test_prompt_plus_max_tokens_over_context_is_413(pre: Preprocessor) -> None:
    n = CTX - 10
    assert completion(pre, prompt=[5] * n, max_tokens=10).stop.max_tokens == 10
    err = error(completion, pre, prompt=[5] * n, max_tokens=11)
    assert (err.status, err.code, err.param) == (413, "context_length_exceeded", "max_tokens")
    assert f"{CTX + 1} tokens ({n} in the prompt, 11 in the completion)" in err.message
    err = error(chat, pre, max_completion_tokens=CTX)
    assert (err.status, err.param) == (413, "max_completion_tokens")
    assert completion(pre, prompt=[5] * (CTX - 1)).stop.max_tokens == 1


def test_min_tokens_beyond_context_is_413(pre: Preprocessor) -> None:
    err = error(completion, pre, prompt=[5] * (CTX - 2), min_tokens=5)
    assert (err.status, err.param) == (413, "min_tokens")


# -- other templates and model files --------------------------------------------------------------


def model_with(
    src: Path,
    dst: Path,
    *,
    jinja: str | None = None,
    generation: dict[str, Any] | None = None,
    **tokenizer_config: Any,
) -> Preprocessor:
    """A copy of the tiny model with tokenizer_config overrides (None removes a key)."""
    dst.mkdir()
    for name in ("tokenizer.json", "config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    config = json.loads((src / "tokenizer_config.json").read_text())
    for key, value in tokenizer_config.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (dst / "chat_template.jinja").write_text(jinja)
    if generation is not None:
        (dst / "generation_config.json").write_text(json.dumps(generation))
    return Preprocessor(dst, build_card(dst, "other", context_length=CTX))


def render(p: Preprocessor, **fields: Any) -> str:
    body = {"model": "other", "messages": [{"role": "user", "content": "hi"}], **fields}
    return p.render(parse_chat(json.dumps(body).encode()))


def test_named_templates_and_tools(tiny_model: Path, tmp_path: Path) -> None:
    templates = [
        {"name": "default", "template": "D{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T{{ tools | tojson }}"},
    ]
    p = model_with(tiny_model, tmp_path / "m", chat_template=templates)
    assert render(p) == "Dhi"
    tool = {"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}
    assert json.loads(render(p, tools=[tool])[1:]) == [tool]


def test_template_file_wins(tiny_model: Path, tmp_path: Path) -> None:
    p = model_with(tiny_model, tmp_path / "m", jinja="FILE {{ bos_token }}{{ eos_token }}")
    assert render(p) == f"FILE {BOS}{EOS}"


def test_template_helpers(tiny_model: Path, tmp_path: Path) -> None:
    source = (
        "{{ messages[0].content | tojson }}|{{ {'a': [1]} | tojson(indent=1) }}|"
        "{{ strftime_now('%Y') }}|{% generation %}G{% endgeneration %}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ m.role }}{% endfor %}|"
        "{% if enable_thinking %}think{% endif %}{{ messages | length }}"
    )
    p = model_with(tiny_model, tmp_path / "m", chat_template=source)
    text = render(
        p,
        messages=[{"role": "user", "content": "<b>é</b>"}, {"role": "assistant", "content": "x"}],
        chat_template_kwargs={"enable_thinking": True, "messages": []},
    )
    year = datetime.now().strftime("%Y")
    assert text == f'"<b>é</b>"|{{\n "a": [\n  1\n ]\n}}|{year}|G|user|think2'


def test_tool_call_arguments_become_mappings(tiny_model: Path, tmp_path: Path) -> None:
    source = (
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ c.function.arguments.city }}{% endfor %}{% endfor %}"
    )
    p = model_with(tiny_model, tmp_path / "m", chat_template=source)
    call = {
        "id": "1",
        "type": "function",
        "function": {"name": "w", "arguments": '{"city": "Oslo"}'},
    }
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "tool_calls": [call]}]
    assert render(p, messages=messages) == "Oslo"


@pytest.mark.parametrize(
    "source",
    ["{{ messages[0].content + 1 }}", "{{ raise_exception('nope') }}", "{{ 1 // 0 }}"],
)
def test_broken_templates_are_400(tiny_model: Path, tmp_path: Path, source: str) -> None:
    p = model_with(tiny_model, tmp_path / "m", chat_template=source)
    err = error(render, p)
    assert err.status == 400 and err.param == "messages"


def test_no_template_is_400(tiny_model: Path, tmp_path: Path) -> None:
    p = model_with(tiny_model, tmp_path / "m", chat_template=None)
    err = error(render, p)
    assert err.status == 400 and "no chat template" in err.message
    assert p.completion(parse_completion(b'{"model": "other", "prompt": "hi"}')).token_ids


def test_added_token_dicts_and_eos_lists(tiny_model: Path, tmp_path: Path) -> None:
    p = model_with(
        tiny_model,
        tmp_path / "m",
        bos_token={"content": BOS, "special": True},
        eos_token={"content": EOS, "special": True},
        generation={"eos_token_id": [3, 2]},
    )
    assert (p.bos_token, p.eos_token) == (BOS, EOS)
    assert p.eos_token_ids == [3, 2]
    assert render(p).startswith(BOS)
