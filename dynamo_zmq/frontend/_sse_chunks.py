"""A streamed request's SSE chunks: what a batch of one choice's outputs becomes (``SseChunks``),
with the logprobs, reasoning and tool-call deltas in OpenAI's shapes, and usage on every chunk
when the request asked for it (``continuous_usage_stats``)."""

from __future__ import annotations

from typing import Any

from ..llm import FinishReason, LLMEngineOutput
from . import errors as http_errors
from ._prompt_logprobs import prompt_logprobs_field
from ._subrequests import SubRequest
from .errors import HttpError
from .responses import ChatFormatter, CompletionFormatter, openai_finish_reason

__all__ = ["Failed", "SseChunks", "gathered_logprobs", "take_logprobs", "take_prompt_logprobs"]


class Failed(Exception):
    """Ends a request's merge loop with the error the client gets."""

    def __init__(self, error: HttpError) -> None:
        super().__init__(error.message)
        self.error = error


def take_logprobs(fmt: ChatFormatter | CompletionFormatter, sub: SubRequest,
                  out: LLMEngineOutput) -> dict[str, Any]:
    """The ``logprobs`` of ``out``'s tokens, in the choice's shape (kept for the whole)."""
    lp = sub.logprobs
    assert lp is not None
    return lp.chat(out) if isinstance(fmt, ChatFormatter) else lp.completion(out)


def take_prompt_logprobs(sub: SubRequest, out: LLMEngineOutput) -> dict[str, Any] | None:
    """Keep the prompt's logprobs (``sub.prompt_logprobs``) from the output that carries them
    (a migration's continuation's are not asked for); returns completions' ``logprobs`` of the
    echoed prompt, when the choice echoes it with logprobs."""
    if out.prompt_logprobs is None or sub.prompt_logprobs is not None:
        return None
    sub.prompt_logprobs = prompt_logprobs_field(out)
    if sub.echo and sub.logprobs is not None:
        return sub.logprobs.completion_prompt(out)
    return None


def gathered_logprobs(fmt: ChatFormatter | CompletionFormatter,
                      sub: SubRequest) -> dict[str, Any] | None:
    """The ``logprobs`` of every token of ``sub`` so far (None: none asked for)."""
    lp = sub.logprobs
    if lp is None:
        return None
    return lp.chat_full() if isinstance(fmt, ChatFormatter) else lp.completion_full()


class SseChunks:
    """Turns batches of a request's outputs into SSE chunks.

    Args:
        fmt: the chat or completion formatter.
        prompt_tokens: the request's prompt tokens (usage on every chunk).
        parsed: the outputs carry the worker's reasoning and tool-call parsing (chat).
    """

    __slots__ = ("fmt", "parsed", "prompt_tokens")

    def __init__(self, fmt: ChatFormatter | CompletionFormatter, prompt_tokens: int,
                 parsed: bool) -> None:
        self.fmt, self.prompt_tokens, self.parsed = fmt, prompt_tokens, parsed

    def batch(self, sub: SubRequest, outs: list[LLMEngineOutput], parts: list[bytes],
              completion: int) -> bool:
        """Add the SSE chunks of a batch of ``sub``'s outputs to ``parts``; True if it
        finished (``completion``: the request's completion tokens so far, for usage).
        Outputs that arrived together go out as one content chunk (their texts,
        and logprobs, joined: a client that is behind reads fewer, larger events, as from
        vLLM's server); nothing is held back for later."""
        if self.parsed:  # reasoning and tool-call deltas: a chunk per output
            for out in outs:
                self._parsed(sub, out, parts, completion)
                if out.finish_reason is not None:
                    parts.append(self.finish(sub, out, completion))
                    return True
            return False
        fmt = self.fmt
        texts: list[str] = []
        logprobs: dict[str, Any] | None = None
        finish: LLMEngineOutput | None = None
        with_logprobs = sub.logprobs is not None
        for out in outs:
            if sub.echo and not sub.echo_sent:  # echo with logprobs: the prompt's go with it
                sub.echo_sent = True
                texts.append(sub.echo)
                logprobs = take_prompt_logprobs(sub, out)
            if out.text:
                texts.append(out.text)
            if with_logprobs and out.log_probs:
                lp = take_logprobs(fmt, sub, out)
                if logprobs is None:
                    logprobs = lp
                else:
                    for key, values in lp.items():
                        logprobs[key] += values
            if out.finish_reason is not None:
                finish = out
                break
        if logprobs is not None:
            chunk = fmt.logprobs_chunk("".join(texts), logprobs, sub.index)
        elif texts:
            chunk = fmt.content_chunk_at(sub.index, texts[0] if len(texts) == 1
                                         else "".join(texts))
        else:
            chunk = b""
        if chunk:
            if fmt.continuous_usage:
                chunk = fmt.with_usage(chunk, self.prompt_tokens, completion)
            parts.append(chunk)
        if finish is None:
            return False
        parts.append(self.finish(sub, finish, completion))
        return True

    def finish(self, sub: SubRequest, out: LLMEngineOutput, completion: int) -> bytes:
        """The finish chunk of ``sub`` (``out`` is its terminal output; an engine error
        raises ``Failed``)."""
        if out.finish_reason == FinishReason.ERROR:
            raise Failed(http_errors.engine_error(out.error or "engine error"))
        sub.finish = out.finish_reason
        sub.stop_reason = out.stop_reason
        chunk = self.fmt.finish_chunk(
            openai_finish_reason(out.finish_reason or FinishReason.STOP), out.stop_reason,
            sub.index,
        )
        if self.fmt.continuous_usage:
            chunk = self.fmt.with_usage(chunk, self.prompt_tokens, completion)
        return chunk

    def _parsed(self, sub: SubRequest, out: LLMEngineOutput, parts: list[bytes],
                completion: int) -> None:
        """A chat output's reasoning, content (with its logprobs) and tool-call chunks."""
        fmt = self.fmt
        assert isinstance(fmt, ChatFormatter)
        text = out.text or ""
        chunks = []
        if out.reasoning:
            chunks.append(fmt.reasoning_chunk(out.reasoning, sub.index))
        if sub.logprobs is not None and out.log_probs:
            chunks.append(fmt.logprobs_chunk(text, take_logprobs(fmt, sub, out), sub.index))
        elif text:
            chunks.append(fmt.content_chunk_at(sub.index, text))
        if out.tool_calls:
            chunks.append(fmt.tool_calls_chunk(out.tool_calls, sub.index))
        for chunk in chunks:
            if fmt.continuous_usage:
                chunk = fmt.with_usage(chunk, self.prompt_tokens, completion)
            parts.append(chunk)
