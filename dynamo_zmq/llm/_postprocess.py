"""Worker-side post-processing: incremental detokenization and stop strings.

The frontend sends token ids; the worker turns the engine's token stream back into text, so this
work scales with the engines (see docs/architecture.md, "Frontend"). Three pieces, each usable
alone:

- ``IncrementalDetokenizer``: token ids -> text deltas (``tokenizers.decoders.DecodeStream``),
  never emitting half a UTF-8 character that a later token completes.
- ``StopStringMatcher`` (``_stop_strings``): text deltas -> text deltas cut at the first stop
  string, holding back only what could still become a stop string.
- ``postprocess(stream, request, tokenizer, stop_engine)``: wraps an engine stream; each engine
  chunk becomes one chunk with ``token_ids`` and a ``text`` delta, and the stream ends with
  exactly one terminal. A stop string ends it early with ``finish_reason="stop"`` and
  ``stop_reason`` the string, then the worker's ``stop_engine()`` frees the engine sequence.
  An engine's ``stop`` ending on a stop token becomes ``stop`` with ``stop_reason`` its id, and
  one ending on an end-of-sequence token becomes ``eos`` (the request-flow document's EoS).

A migrated request (``request.resume``) ends in prompt tokens that are output a lost worker
already streamed: ``PostProcessor`` replays them through the detokenizer, the stop-string
matcher and the tool-call and reasoning parsers without emitting their text, so the stream
continues exactly where the client's text stops (inside a tool call's arguments or the
reasoning, if that is where it was; call ids derive from the request's id, so the call keeps
its id), and its usage counts them as output.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

from ._logprobs import TokenTexts, prompt_logprob_texts, with_logprob_texts
from ._messages import FinishReason, LLMEngineOutput, PreprocessedRequest, Usage
from ._stop_strings import StopStringMatcher
from .parsers import output_parser

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "IncrementalDetokenizer",
    "PostProcessor",
    "postprocess",
    "resumed_usage",
    "with_resumed_usage",
]

#: What a lossy UTF-8 decode puts where a character is incomplete.
REPLACEMENT = "\ufffd"
#: Prompt tokens the detokenizer sees before the first generated one (leading spaces, merges).
PROMPT_CONTEXT = 8
#: Finish reasons some engines use, mapped to ours.
_FINISH_ALIASES = {
    "stop_token": FinishReason.STOP,
    "max_tokens": FinishReason.LENGTH,
    "abort": FinishReason.CANCELLED,
}


class IncrementalDetokenizer:
    """Token ids in, text deltas out; their concatenation plus ``flush()`` is the full decode.

    ``DecodeStream`` returns ``None`` while the decoded window ends in an incomplete character,
    so a delta never carries a replacement character that a later token would complete. It is
    seeded with the last ``PROMPT_CONTEXT`` prompt tokens, so the first generated token decodes
    as it would in context (SentencePiece-style decoders drop a leading space otherwise).

    Args:
        tokenizer: the model's ``tokenizers.Tokenizer``.
        prompt_ids: the prompt; only its tail is used, as context.
        skip_special_tokens: leave special tokens out of the text.
    """

    __slots__ = ("_done", "_pending", "_skip", "_stream", "_tokenizer")

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        seed = list(prompt_ids[-PROMPT_CONTEXT:])
        # A seed whose text ends in an incomplete character makes DecodeStream start from an
        # empty prefix, and the seed's text would leak into the first delta: cut it back.
        while seed and self._decode(seed).endswith(REPLACEMENT):
            seed.pop()
        self._stream = DecodeStream(seed, skip_special_tokens=skip_special_tokens)
        #: Ids whose text is out, ending on a character boundary (context for ``flush``).
        self._done: list[int] = seed
        #: Ids fed since the last delta (their text is still incomplete, or empty).
        self._pending: list[int] = []

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def step(self, token_id: int) -> str:
        """Add one token; returns the new text ("" while a character is incomplete)."""
        pending = self._pending
        pending.append(token_id)
        text = self._stream.step(self._tokenizer, token_id)
        if text is None:
            return ""
        self._done, self._pending = pending, []
        return text

    def flush(self) -> str:
        """The text still held back at the end of the stream (incomplete characters decode to
        replacement characters, as a full decode would). Call once, after the last ``step``."""
        if not self._pending:
            return ""
        base = self._decode(self._done)
        full = self._decode(self._done + self._pending)
        text = full[len(base) :] if full.startswith(base) else self._decode(self._pending)
        self._done, self._pending = self._pending, []
        return text


class PostProcessor:
    """Per-request state: turns each engine chunk into one chunk with ``token_ids`` and ``text``.

    Text comes from the detokenizer, or from the engine itself when ``request.output.detokenize``
    asks for native processing (``tokenizer`` may then be None). Stop strings apply either way,
    after ``request.stop.min_tokens`` tokens, as vLLM applies them. Then, when the request asks
    for it and the worker has the parsers (``tool_parser`` / ``reasoning_parser`` names,
    ``llm.parsers``), reasoning and tool calls are parsed out of the text.

    Raises:
        ValueError: no tokenizer and the request does not ask the engine for text.
    """

    def __init__(
        self, request: PreprocessedRequest, tokenizer: Tokenizer | None,
        tool_parser: str | None = None, reasoning_parser: str | None = None,
        id_seed: str = "",
    ) -> None:
        if tokenizer is None and not request.output.detokenize:
            raise ValueError("a tokenizer is needed unless the engine detokenizes")
        resume = request.resume
        generated = resume.generated if resume is not None else 0
        ids = request.token_ids
        prompt = ids[: len(ids) - generated] if generated else ids
        self._detok = (
            None
            if request.output.detokenize or tokenizer is None
            else IncrementalDetokenizer(tokenizer, prompt, request.output.skip_special_tokens)
        )
        stop = request.stop
        self._matcher = StopStringMatcher(stop.stop, stop.include_stop_str_in_output)
        self._min_tokens = stop.min_tokens if resume is None else resume.min_tokens
        # EOS / stop-token text stays out of the output unless asked for (vLLM's rule).
        self._stop_ids = (
            frozenset() if stop.include_stop_str_in_output
            else frozenset(request.eos_token_ids) | frozenset(stop.stop_token_ids)
        )
        # Read at the terminal only, to tell an end-of-sequence token from a stop token.
        self._stop_token_ids = stop.stop_token_ids
        self._eos_token_ids = request.eos_token_ids
        self._prompt_tokens = len(prompt)
        self.completion_tokens = 0
        #: True once a stop string ended the stream.
        self.stopped_by_string = False
        # Tool-call and reasoning parsing, after stop strings (None: the request needs none).
        # Tool call ids derive from ``id_seed`` (the request's id), so a continuation names them
        # as the lost worker did.
        self._parser = output_parser(request, tool_parser, reasoning_parser, id_seed)
        # Most chunks are one token of a request without stop strings or parsers: ``process``
        # then only calls the detokenizer's step (None: every chunk takes the full path).
        self._plain_step: Callable[[int], str] | None = (
            self._detok.step
            if self._detok is not None and not self._matcher.stops and self._parser is None
            else None
        )
        self._resumed = generated
        if generated:
            self._replay(ids[len(prompt) :])
        if request.output.logprobs is not None:
            # Per request: the texts of each token's logprobs (replayed tokens have none); an
            # engine that detokenizes itself gives its own.
            self._texts = (
                None if tokenizer is None or request.output.detokenize
                else TokenTexts(tokenizer, ids[len(prompt) :])
            )
            self.process = self._process_logprobs  # type: ignore[method-assign]
        if request.output.prompt_logprobs is not None:
            # Per request: the prompt's logprobs pass through, with their texts.
            self._prompt_ids = ids
            self._prompt_tokenizer = None if request.output.detokenize else tokenizer
            self._inner = self.process
            self.process = self._process_prompt  # type: ignore[method-assign]

    def _replay(self, ids: list[int]) -> None:
        """Bring the detokenizer, the stop-string matcher and the tool-call and reasoning
        parsers to where the lost worker left them after ``ids`` (output the client already
        has): their text is not emitted again, what the lost worker still held back stays held,
        and a tool call or reasoning it was in the middle of goes on as such."""
        parser = self._parser
        for token in ids:
            self.completion_tokens += 1
            if self._detok is not None:
                text = self._match(self._detok.step(token))[0]
                if parser is not None:
                    parser.replay(text)

    def _process_logprobs(self, out: LLMEngineOutput) -> LLMEngineOutput:
        """``process`` for a request that asked for logprobs: the chunk's logprobs stay aligned
        with the token ids that reach the client, and gain their texts."""
        return with_logprob_texts(PostProcessor.process(self, out), out, self._texts)

    def _process_prompt(self, out: LLMEngineOutput) -> LLMEngineOutput:
        """``process`` for a request that asked for prompt logprobs: the chunk that carries
        them keeps them, with their texts (``prompt_logprob_texts``)."""
        chunk = self._inner(out)
        if out.prompt_logprobs is not None:
            chunk.prompt_logprobs = out.prompt_logprobs
            tokenizer = self._prompt_tokenizer
            chunk.prompt_logprob_texts = (
                out.prompt_logprob_texts if tokenizer is None
                else prompt_logprob_texts(tokenizer, self._prompt_ids, out.prompt_logprobs)
            )
        return chunk

    def process(self, out: LLMEngineOutput) -> LLMEngineOutput:
        """One engine chunk in, one chunk out; the result is terminal when the stream ends here
        (the engine's terminal, or a stop string)."""
        ids = out.token_ids
        step = self._plain_step
        if step is not None and out.finish_reason is None and len(ids) == 1:
            self.completion_tokens += 1
            return LLMEngineOutput(ids, text=step(ids[0]), log_probs=out.log_probs)
        if self._parser is not None:
            return self._parser.apply(self._process(out))
        return self._process(out)

    def _process(self, out: LLMEngineOutput) -> LLMEngineOutput:
        ids = out.token_ids
        parts: list[str] = []
        if self._detok is None:
            self.completion_tokens += len(ids)
            text, matched = self._match(out.text or "")
            parts.append(text)
            if matched:
                return self._stopped(out, ids, parts)
        else:
            skip_last = (
                out.finish_reason == FinishReason.STOP and bool(ids) and ids[-1] in self._stop_ids
            )
            for n, token in enumerate(ids):
                self.completion_tokens += 1
                delta = "" if skip_last and n == len(ids) - 1 else self._detok.step(token)
                text, matched = self._match(delta)
                parts.append(text)
                if matched:
                    return self._stopped(out, ids[: n + 1], parts)
        if not out.is_terminal:
            return LLMEngineOutput(ids, text="".join(parts), log_probs=out.log_probs)
        if self._detok is not None:
            text, matched = self._match(self._detok.flush())
            parts.append(text)
            if matched:
                return self._stopped(out, ids, parts)
        parts.append(self._matcher.flush())
        reason = out.finish_reason or FinishReason.ERROR
        reason = _FINISH_ALIASES.get(reason, reason)
        stop_reason = out.stop_reason
        if reason == FinishReason.STOP and not isinstance(stop_reason, str):
            # the token that stopped it: the one the engine names, else the chunk's last
            last = stop_reason if stop_reason is not None else (ids[-1] if ids else None)
            if last is not None:
                reason, stop_reason = self._stopped_by_token(last, stop_reason)
        usage = self._usage(out.usage)
        return LLMEngineOutput(
            ids, text="".join(parts), finish_reason=reason, usage=usage, error=out.error,
            log_probs=out.log_probs, stop_reason=stop_reason,
            kv_handoff=out.kv_handoff,
        )

    def _usage(self, engine: Usage | None) -> Usage:
        """The terminal's usage: the engine's if it gave one (corrected for a resumed request,
        whose engine counts the replayed output as prompt), else the post-processor's count."""
        if engine is None:
            return Usage(self._prompt_tokens, self.completion_tokens)
        return resumed_usage(engine, self._resumed)

    def _stopped_by_token(self, token: int, said: int | None) -> tuple[str, int | None]:
        """The finish of an engine's ``stop`` on ``token``: a stop token the request named
        (``stop`` with that id), else an end-of-sequence token (``eos``; engines such as our
        vLLM adapter get the model's end-of-sequence ids as stop tokens, so vLLM may name one),
        else ``stop`` with what the engine ``said``."""
        if token in self._stop_token_ids:
            return FinishReason.STOP, token
        if token in self._eos_token_ids:
            return FinishReason.EOS, None
        return FinishReason.STOP, said

    def missing_terminal(self) -> LLMEngineOutput:
        """The terminal for an engine stream that ended without one: an error, after the text
        still held back."""
        text = self._detok.flush() if self._detok is not None else ""
        out = LLMEngineOutput(
            text=text + self._matcher.flush(), finish_reason=FinishReason.ERROR,
            usage=Usage(self._prompt_tokens, self.completion_tokens),
            error="engine stream ended without a terminal chunk",
        )
        return out if self._parser is None else self._parser.apply(out)

    def _match(self, delta: str) -> tuple[str, bool]:
        if not self._matcher.stops:
            return delta, False
        if self.completion_tokens <= self._min_tokens:
            return self._matcher.flush() + delta, False
        return self._matcher.feed(delta)

    def _stopped(self, out: LLMEngineOutput, ids: list[int], parts: list[str]) -> LLMEngineOutput:
        self.stopped_by_string = True
        log_probs = out.log_probs[: len(ids)] if out.log_probs is not None else None
        return LLMEngineOutput(
            ids, text="".join(parts), finish_reason=FinishReason.STOP,
            usage=Usage(self._prompt_tokens, self.completion_tokens), log_probs=log_probs,
            stop_reason=self._matcher.matched,
            kv_handoff=out.kv_handoff if out.is_terminal else None,
        )


def resumed_usage(usage: Usage, generated: int) -> Usage:
    """An engine's usage of a resumed request as the original request's: the ``generated``
    trailing prompt tokens were output, and only the original prompt can have been cached."""
    if not generated:
        return usage
    prompt = max(0, usage.prompt_tokens - generated)
    cached = usage.cached_tokens
    return Usage(prompt, usage.completion_tokens + generated,
                 None if cached is None else min(cached, prompt))


async def with_resumed_usage(
    stream: AsyncIterator[LLMEngineOutput], generated: int
) -> AsyncIterator[LLMEngineOutput]:
    """An engine stream of a resumed request whose chunks pass through as they are (no
    post-processing): only the terminal's usage is corrected (``resumed_usage``)."""
    async for out in stream:
        if out.usage is not None:
            out.usage = resumed_usage(out.usage, generated)
        yield out


async def postprocess(
    stream: AsyncIterator[LLMEngineOutput],
    request: PreprocessedRequest,
    tokenizer: Tokenizer | None,
    stop_engine: Callable[[], Awaitable[None]] | None = None,
    tool_parser: str | None = None,
    reasoning_parser: str | None = None,
    id_seed: str = "",
) -> AsyncIterator[LLMEngineOutput]:
    """Wrap an engine stream with detokenization and stop strings (see ``PostProcessor``).

    Yields exactly one terminal, last. When a stop string ends the stream before the engine
    did, ``stop_engine()`` is awaited before that terminal is yielded and the engine stream is
    not read further. Closing this generator closes ``stream``.

    Args:
        stream: what ``engine.generate(request, ctx)`` returned.
        request: the request being served (stop conditions, output options, prompt).
        tokenizer: the model's tokenizer; None only if the engine produces text itself.
        stop_engine: frees the engine's sequence after a stop string (the worker stops the
            engine's context and calls ``engine.abort``).
        tool_parser / reasoning_parser: the worker's parser names (``llm.parsers``), applied
            as the request asks (its ``tools`` and ``reasoning``).
        id_seed: what tool call ids derive from (the request's id; "": random ids).
    """
    proc = PostProcessor(request, tokenizer, tool_parser, reasoning_parser, id_seed)
    try:
        async for out in stream:
            chunk = proc.process(out)
            if chunk.is_terminal:
                if proc.stopped_by_string and not out.is_terminal and stop_engine is not None:
                    await stop_engine()
                yield chunk
                return
            yield chunk
        yield proc.missing_terminal()
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
