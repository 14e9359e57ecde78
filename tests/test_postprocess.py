"""Worker-side post-processing: incremental detokenizer, stop strings, and the stream wrapper."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from dynamo_zmq.llm import (
    IncrementalDetokenizer,
    LLMEngineOutput,
    OutputOptions,
    PostProcessor,
    PreprocessedRequest,
    Resume,
    StopConditions,
    StopStringMatcher,
    Usage,
    postprocess,
)
from dynamo_zmq.llm._postprocess import REPLACEMENT

EOS = 2
PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
#: ASCII, 2-, 3- and 4-byte UTF-8 characters, so characters split across byte-level tokens.
TEXT = st.text(
    alphabet=st.sampled_from([*"ab the,.\n", "é", "ü", "日", "本", "🙂", "€"]), max_size=40
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def detokenize(tokenizer, ids, prompt=(), skip=True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    return [detok.step(t) for t in ids] + [detok.flush()]


def cut_reference(text: str, stops: list[str], include: bool) -> tuple[str, int | None, str | None]:
    """The text up to the first stop string to complete (the longest on a tie), where that stop
    string starts, and which it is; (text, None, None) when no stop string occurs."""
    stops = [s for s in stops if s]
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text.endswith(s, 0, end)]
        if hits:
            stop = max(hits, key=len)
            start = end - len(stop)
            return text[: end if include else start], start, stop
    return text, None, None


def request(ids, *, prompt=(1,), **stop) -> PreprocessedRequest:
    output = OutputOptions(detokenize=stop.pop("detokenize", False),
                           skip_special_tokens=stop.pop("skip_special_tokens", True))
    return PreprocessedRequest(
        list(prompt), stop=StopConditions(**stop), output=output, eos_token_ids=[EOS]
    )


def run(proc: PostProcessor, chunks: list[LLMEngineOutput]) -> list[LLMEngineOutput]:
    out = []
    for chunk in chunks:
        out.append(proc.process(chunk))
        if out[-1].is_terminal:
            break
    return out


def one_per_token(ids, finish="length") -> list[LLMEngineOutput]:
    return [LLMEngineOutput([t]) for t in ids] + [
        LLMEngineOutput(finish_reason=finish, usage=Usage(1, len(ids)))
    ]


def text_of(chunks) -> str:
    return "".join(c.text or "" for c in chunks)


# -- IncrementalDetokenizer ------------------------------------------------------------------


@PROPS
@given(data=st.data(), skip=st.booleans())
def test_deltas_concatenate_to_the_full_decode_of_any_ids(tokenizer, data, skip):
    vocab = tokenizer.get_vocab_size()
    ids = data.draw(st.lists(st.integers(0, vocab - 1), max_size=40))
    prompt = data.draw(st.lists(st.integers(0, vocab - 1), max_size=12))
    assert "".join(detokenize(tokenizer, ids, prompt, skip)) == tokenizer.decode(
        ids, skip_special_tokens=skip
    )


@PROPS
@given(text=TEXT, prompt=TEXT)
def test_split_characters_never_show_as_replacement_chars(tokenizer, text, prompt):
    ids = encode(tokenizer, text)
    deltas = detokenize(tokenizer, ids, encode(tokenizer, prompt))
    assert "".join(deltas) == text
    assert not any(REPLACEMENT in d for d in deltas)


def test_a_split_character_comes_out_whole_with_its_last_token(tokenizer):
    ids = encode(tokenizer, "a 日b")
    deltas = detokenize(tokenizer, ids)
    assert "日" in deltas and "".join(deltas) == "a 日b"
    assert "" in deltas  # the first byte(s) of 日 gave no text yet


def test_an_incomplete_character_at_the_end_flushes_as_a_full_decode_would(tokenizer):
    ids = encode(tokenizer, "ok 日")[:-1]  # drop the last byte of 日
    deltas = detokenize(tokenizer, ids)
    assert deltas[-1].endswith(REPLACEMENT) and "".join(deltas) == tokenizer.decode(ids)


def test_a_prompt_ending_mid_character_does_not_leak_into_the_first_delta(tokenizer):
    prompt = encode(tokenizer, "Hello 日")[:-1]
    assert tokenizer.decode(prompt).endswith(REPLACEMENT)
    ids = encode(tokenizer, " world")
    assert "".join(detokenize(tokenizer, ids, prompt)) == " world"


def test_prompt_context_gives_the_first_token_its_leading_space():
    # SentencePiece-style: the decoder drops the leading space of the first token of a decode.
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    assert tok.decode([2, 3]) == "world!" and tok.decode([1, 2, 3]) == "Hello world!"
    assert "".join(detokenize(tok, [2, 3], prompt=[1])) == " world!"
    assert "".join(detokenize(tok, [2, 3])) == "world!"


# -- StopStringMatcher -----------------------------------------------------------------------


def split(draw, text: str) -> list[str]:
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@settings(PROPS, max_examples=400)
@given(data=st.data(), include=st.booleans())
def test_stop_strings_cut_the_text_and_never_leak(data, include):
    alphabet = st.sampled_from("ab\nx")
    text = data.draw(st.text(alphabet, max_size=30))
    stops = data.draw(st.lists(st.text(alphabet, max_size=4), max_size=3))
    for _ in range(data.draw(st.integers(0, 2))):  # pieces of the text itself match more often
        i = data.draw(st.integers(0, len(text)))
        stops.append(text[i : i + data.draw(st.integers(1, 4))])
    deltas = split(data.draw, text)
    expected, start, stop = cut_reference(text, stops, include)
    longest = max((len(s) for s in stops), default=0)
    matcher = StopStringMatcher(stops, include)
    emitted, fed, matched = "", "", False
    for delta in deltas:
        text_out, matched = matcher.feed(delta)
        emitted += text_out
        fed += delta
        if matched:
            break
        # Nothing of a stop string that matches later, and at most max(len)-1 chars held back.
        assert (text if start is None else text[:start]).startswith(emitted)
        assert len(fed) - len(emitted) <= max(0, longest - 1)
    if not matched:
        emitted += matcher.flush()
    assert emitted == expected
    assert matched == (start is not None)
    assert matcher.matched == stop


def test_stop_matcher_reports_the_first_stop_to_complete():
    matcher = StopStringMatcher(["bcd", "c"], include_stop_str=True)
    assert matcher.feed("abcd") == ("abc", True)
    assert matcher.matched == "c"
    assert matcher.feed("more") == ("", True)


def test_stop_matcher_holds_only_what_could_become_a_stop():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("hello S") == ("hello ", False)
    assert matcher.feed("T") == ("", False)
    assert matcher.feed("x") == ("STx", False)
    assert matcher.feed("ST") == ("", False)
    assert matcher.flush() == "ST"
    assert StopStringMatcher([""]).feed("abc") == ("abc", False)


# -- PostProcessor / postprocess ---------------------------------------------------------------


@PROPS
@given(data=st.data(), text=TEXT, include=st.booleans())
def test_postprocessed_stream_matches_a_full_decode_cut_at_the_stop(tokenizer, data, text, include):
    ids = encode(tokenizer, text)
    stops = data.draw(
        st.lists(st.text(st.sampled_from("ab e,日🙂"), min_size=1, max_size=3), max_size=2)
    )
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=len(ids), max_size=len(ids)))
    chunks, i = [], 0
    for n in sizes:
        if i < len(ids):
            chunks.append(LLMEngineOutput(ids[i : i + n]))
            i += n
    chunks.append(LLMEngineOutput(finish_reason="length", usage=Usage(1, len(ids))))
    out = run(
        PostProcessor(request(ids, stop=stops, include_stop_str_in_output=include), tokenizer),
        chunks,
    )
    expected, start, _ = cut_reference(text, stops, include)
    assert text_of(out) == expected
    assert [c.is_terminal for c in out] == [False] * (len(out) - 1) + [True]
    sent = [t for c in out for t in c.token_ids]
    if start is None:
        assert out[-1].finish_reason == "length" and sent == ids
    else:
        # The stream stops at the token that completes the stop string.
        k = next(
            k for k in range(1, len(ids) + 1) if any(s in tokenizer.decode(ids[:k]) for s in stops)
        )
        assert sent == ids[:k]
        assert out[-1].finish_reason == "stop" and out[-1].usage == Usage(1, k)


def test_text_rides_with_the_token_ids(tokenizer):
    ids = encode(tokenizer, "the engine é")
    out = run(PostProcessor(request(ids), tokenizer), one_per_token(ids))
    assert [c.token_ids for c in out[:-1]] == [[t] for t in ids]
    assert text_of(out) == "the engine é"
    assert out[-1].finish_reason == "length" and out[-1].usage == Usage(1, len(ids))


def test_held_back_text_is_flushed_before_a_length_terminal(tokenizer):
    ids = encode(tokenizer, "see ST")
    out = run(PostProcessor(request(ids, stop=["STOP"]), tokenizer), one_per_token(ids))
    assert out[-2].text == "" and out[-1].text == "ST" and text_of(out) == "see ST"


def test_eos_text_stays_out_unless_asked(tokenizer):
    ids = encode(tokenizer, "hi")
    chunks = [LLMEngineOutput(ids), LLMEngineOutput([EOS], finish_reason="stop", usage=Usage(1, 3))]
    out = run(PostProcessor(request(ids, skip_special_tokens=False), tokenizer), chunks)
    # (the end-of-sequence token ends it as EoS, the request-flow document's FinishReason)
    assert text_of(out) == "hi" and out[-1].token_ids == [EOS] and out[-1].finish_reason == "eos"
    kept = run(PostProcessor(request(ids, skip_special_tokens=False,
                                     include_stop_str_in_output=True), tokenizer), chunks)
    assert text_of(kept) == "hi</s>"


def test_engine_errors_pass_through_with_the_held_text(tokenizer):
    ids = encode(tokenizer, "bad S")
    chunks = [LLMEngineOutput(ids), LLMEngineOutput(finish_reason="error", error="boom")]
    out = run(PostProcessor(request(ids, stop=["STOP"]), tokenizer), chunks)
    assert out[-1].finish_reason == "error" and out[-1].error == "boom"
    assert text_of(out) == "bad S"


def test_finish_reason_aliases_map_to_the_wire_ones(tokenizer):
    proc = PostProcessor(request([]), tokenizer)
    assert proc.process(LLMEngineOutput(finish_reason="eos")).finish_reason == "eos"
    proc = PostProcessor(request([]), tokenizer)
    assert proc.process(LLMEngineOutput(finish_reason="max_tokens")).finish_reason == "length"


def test_stop_strings_wait_for_min_tokens(tokenizer):
    ids = encode(tokenizer, "a a a")
    out = run(PostProcessor(request(ids, stop=["a"], min_tokens=2), tokenizer), one_per_token(ids))
    assert out[-1].finish_reason == "stop"
    assert text_of(out) == tokenizer.decode(ids[:2]) + tokenizer.decode([ids[2]])[:-1]


def test_native_text_passes_through_with_stop_strings():
    chunks = [LLMEngineOutput([5], text="Hello"), LLMEngineOutput([6], text=" wor"),
              LLMEngineOutput([7], text="ld. More"), LLMEngineOutput([8], text=" text")]
    req = request([], stop=["ld."], detokenize=True)
    out = run(PostProcessor(req, None), chunks)
    assert (
        text_of(out) == "Hello wor"
        and out[-1].finish_reason == "stop"
        and out[-1].usage == Usage(1, 3)
    )
    with pytest.raises(ValueError):
        PostProcessor(request([]), None)


async def test_stop_string_stops_the_engine_and_reads_no_further(tokenizer):
    ids = encode(tokenizer, "one two STOP three four")
    read: list[int] = []
    closed = []
    stopped = []

    async def engine() -> AsyncIterator[LLMEngineOutput]:
        try:
            for chunk in one_per_token(ids):
                read.extend(chunk.token_ids)
                yield chunk
        finally:
            closed.append(True)

    async def stop_engine() -> None:
        stopped.append(len(read))

    out = [
        c async for c in postprocess(engine(), request(ids, stop=[" STOP"]), tokenizer, stop_engine)
    ]
    k = next(k for k in range(1, len(ids) + 1) if " STOP" in tokenizer.decode(ids[:k]))
    assert text_of(out) == "one two" and out[-1].finish_reason == "stop"
    assert out[-1].usage == Usage(1, k) and sum(len(c.token_ids) for c in out) == k
    assert stopped == [k] and read == ids[:k] and closed == [True]


async def test_a_stream_without_terminal_gets_one(tokenizer):
    ids = encode(tokenizer, "abc")

    async def engine() -> AsyncIterator[LLMEngineOutput]:
        yield LLMEngineOutput(ids)

    out = [c async for c in postprocess(engine(), request(ids), tokenizer)]
    assert [c.is_terminal for c in out] == [False, True]
    assert out[-1].finish_reason == "error" and "without a terminal" in (out[-1].error or "")
    assert text_of(out) == "abc"


def _logprob_request(tokenizer, prompt: str, generated=(), **stop) -> PreprocessedRequest:
    ids = encode(tokenizer, prompt) + list(generated)
    return PreprocessedRequest(
        token_ids=ids, stop=StopConditions(**stop), output=OutputOptions(logprobs=1),
        resume=Resume(generated=len(generated)) if generated else None,
    )


def test_logprobs_stay_aligned_with_the_tokens_a_stop_string_lets_through(tokenizer):
    ids = encode(tokenizer, "ab the end and more")
    stop_at = next(i for i in range(1, len(ids)) if "end" in tokenizer.decode(ids[: i + 1]))
    proc = PostProcessor(_logprob_request(tokenizer, "x", stop=["end"]), tokenizer)
    top = [[(t, -0.1)] for t in ids]
    out = proc.process(LLMEngineOutput(ids, log_probs=[-0.1 * i for i in range(len(ids))],
                                       top_logprobs=top))
    n = stop_at + 1
    assert out.finish_reason == "stop" and out.token_ids == ids[:n]
    assert out.log_probs == [-0.1 * i for i in range(n)] and out.top_logprobs == top[:n]
    assert out.logprob_texts == [[tokenizer.decode([t])] * 2 for t in ids[:n]]


def test_a_resumed_request_replays_without_logprobs_and_completes_its_characters(tokenizer):
    """The replayed tokens give no logprobs; a character the replay began is completed by the
    first new token's text (the replayed tokens are its context, as vLLM's sampled ones)."""
    ids = encode(tokenizer, "café")
    split = next(i for i in range(len(ids)) if tokenizer.decode([ids[i]]).endswith(REPLACEMENT))
    assert split + 1 < len(ids)
    proc = PostProcessor(_logprob_request(tokenizer, "hello", ids[: split + 1]), tokenizer)
    rest = ids[split + 1 :]
    out = proc.process(LLMEngineOutput(rest, log_probs=[-1.0] * len(rest)))
    assert out.log_probs == [-1.0] * len(rest) and out.top_logprobs is None
    assert "".join(t[0] for t in out.logprob_texts) == "é"


def test_no_logprobs_asked_none_added(tokenizer):
    proc = PostProcessor(PreprocessedRequest(token_ids=encode(tokenizer, "x")), tokenizer)
    out = proc.process(LLMEngineOutput(encode(tokenizer, "ab")))
    assert out.log_probs is None and out.top_logprobs is None and out.logprob_texts is None
