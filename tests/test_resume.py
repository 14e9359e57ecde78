"""Resuming a migrated request's post-processing: the text a lost worker sent plus the text of
the continuation (the prompt extended by the tokens generated, ``Resume``) is the text of an
uninterrupted run, whatever the tokens, stop strings, chunking and cut point."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from dynamo_zmq.llm import (
    GuidedDecoding,
    LLMEngineOutput,
    PostProcessor,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
    Usage,
    resumable,
)
from dynamo_zmq.llm._migration import continuation

EOS = 2
PROPS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
STOPS = st.lists(st.text(st.sampled_from("ab e,.日🙂"), min_size=1, max_size=3), max_size=2)


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


def chunked(draw, ids: list[int]) -> list[list[int]]:
    """``ids`` in chunks of 1-4 tokens, drawn."""
    out, i = [], 0
    while i < len(ids):
        n = draw(st.integers(1, 4))
        out.append(ids[i : i + n])
        i += n
    return out


def run(proc: PostProcessor, chunks: list[LLMEngineOutput]) -> list[LLMEngineOutput]:
    out = []
    for chunk in chunks:
        out.append(proc.process(chunk))
        if out[-1].is_terminal:
            break
    return out


def text_of(outs: list[LLMEngineOutput]) -> str:
    return "".join(o.text or "" for o in outs)


def tokens_of(outs: list[LLMEngineOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def engine_chunks(parts: list[list[int]], terminal: LLMEngineOutput) -> list[LLMEngineOutput]:
    return [LLMEngineOutput(p) for p in parts] + [terminal]


@PROPS
@given(data=st.data())
def test_text_after_k_tokens_does_not_depend_on_chunking(tokenizer, data):
    """What post-processing has emitted once it has seen k tokens is the same however the k
    tokens were chunked (what a resumed worker's replay relies on)."""
    vocab = tokenizer.get_vocab_size()
    ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=30))
    prompt = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=10))
    stops = data.draw(STOPS)
    request = PreprocessedRequest(
        prompt, stop=StopConditions(stop=stops, min_tokens=data.draw(st.integers(0, 3))),
        eos_token_ids=[EOS],
    )
    per_token, text = {}, ""
    proc = PostProcessor(request, tokenizer)
    for k, t in enumerate(ids, 1):
        out = proc.process(LLMEngineOutput([t]))
        text += out.text or ""
        per_token[k] = text
        if out.is_terminal:
            break
    proc, text, k = PostProcessor(request, tokenizer), "", 0
    for part in chunked(data.draw, ids):
        out = proc.process(LLMEngineOutput(part))
        text += out.text or ""
        if out.is_terminal:
            break
        k += len(part)
        assert text == per_token[k]


@PROPS
@given(data=st.data(), include=st.booleans(), eos=st.booleans())
def test_text_before_a_cut_plus_the_resumed_text_is_the_uninterrupted_text(
    tokenizer, data, include, eos
):
    vocab = tokenizer.get_vocab_size()
    ids = data.draw(st.lists(st.integers(3, vocab - 1), min_size=2, max_size=30))
    prompt = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=10))
    min_tokens = data.draw(st.integers(0, 4))
    request = PreprocessedRequest(
        prompt,
        stop=StopConditions(
            max_tokens=len(ids) + (1 if eos else 0) + data.draw(st.integers(0, 3)),
            min_tokens=min_tokens, stop=data.draw(STOPS), include_stop_str_in_output=include,
        ),
        eos_token_ids=[EOS],
    )
    total = len(ids) + (1 if eos else 0)
    last = [EOS] if eos else []

    def terminal(prompt_tokens: int, completion: int, cached: int) -> LLMEngineOutput:
        return LLMEngineOutput(
            last, finish_reason="stop" if eos else "length",
            usage=Usage(prompt_tokens, completion, cached),
        )

    whole = run(
        PostProcessor(request, tokenizer),
        engine_chunks(chunked(data.draw, ids), terminal(len(prompt), total, len(prompt))),
    )
    cut = data.draw(st.integers(1, len(ids) - 1))
    first = run(PostProcessor(request, tokenizer),
                [LLMEngineOutput(p) for p in chunked(data.draw, ids[:cut])])
    if first and first[-1].is_terminal:  # a stop string ended it before the cut
        assert text_of(first) == text_of(whole) and tokens_of(first) == tokens_of(whole)
        return
    resumed_request = continuation(request, tokens_of(first))
    assert resumed_request is not None and request.token_ids == prompt  # not modified
    assert resumed_request.stop.min_tokens == max(0, min_tokens - cut)
    cached = data.draw(st.integers(0, len(prompt) + cut))
    rest = run(
        PostProcessor(resumed_request, tokenizer),
        engine_chunks(chunked(data.draw, ids[cut:]), terminal(len(prompt) + cut, total - cut,
                                                              cached)),
    )
    assert text_of(first) + text_of(rest) == text_of(whole)
    assert tokens_of(first) + tokens_of(rest) == tokens_of(whole)
    end, end_whole = rest[-1], whole[-1]
    assert end.is_terminal and [o.is_terminal for o in rest[:-1]] == [False] * (len(rest) - 1)
    assert (end.finish_reason, end.stop_reason) == (end_whole.finish_reason, end_whole.stop_reason)
    assert end.usage is not None and end_whole.usage is not None
    assert (end.usage.prompt_tokens, end.usage.completion_tokens) == (
        end_whole.usage.prompt_tokens, end_whole.usage.completion_tokens
    )
    if end.usage.cached_tokens is not None:  # an engine's usage: corrected, never beyond
        assert end.usage.cached_tokens == min(cached, len(prompt))


def test_a_spent_budget_has_no_continuation():
    request = PreprocessedRequest([1, 2], stop=StopConditions(max_tokens=3))
    assert continuation(request, [5, 6, 7]) is None
    resumed = continuation(request, [5, 6])
    assert resumed is not None and resumed.stop.max_tokens == 1
    assert resumed.token_ids == [1, 2, 5, 6] and resumed.resume is not None
    assert resumed.resume.generated == 2 and request.resume is None


def test_resumable_names_what_cannot_be_resumed():
    assert resumable(PreprocessedRequest([1])) is None
    assert resumable(PreprocessedRequest([1], sampling=SamplingOptions(repetition_penalty=1.2))) \
        is None
    for sampling in (SamplingOptions(frequency_penalty=0.5), SamplingOptions(presence_penalty=1),
                     SamplingOptions(n=2)):
        assert resumable(PreprocessedRequest([1], sampling=sampling))
    native = msgspec.structs.replace(PreprocessedRequest([1]))
    native.output.detokenize = True
    assert resumable(native)
    assert resumable(PreprocessedRequest([1], guided=GuidedDecoding(regex="a+")))
