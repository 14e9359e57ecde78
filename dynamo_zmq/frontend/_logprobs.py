"""Logprobs in OpenAI's shapes, from the worker's chunks (``log_probs``, ``top_logprobs`` and
the token texts ``logprob_texts``), for one choice, as vLLM's server writes them.

Each position lists the sampled token, then its top alternatives (duplicates of the sampled
token dropped, as vLLM's per-position dict does); values below -9999 are written as -9999.0.
Chat shows the first ``top_logprobs`` of them; completions show them all (the ``logprobs``
best plus the sampled token, OpenAI's legacy rule). Everything here is per request that asked
for logprobs: nothing runs for one that did not.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..llm import LLMEngineOutput
from .protocol import ChatCompletionRequest, CompletionRequest

__all__ = ["ChoiceLogprobs", "asks_logprobs", "requested_logprobs"]

_FLOOR = -9999.0


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def _positions(
    out: LLMEngineOutput,
) -> Iterator[tuple[str, float, list[tuple[str, float]]]]:
    """Per token of ``out``: its text, its logprob, and the position's entries (text,
    logprob), sampled token first."""
    log_probs, texts = out.log_probs, out.logprob_texts
    if log_probs is None or texts is None:
        return
    tops = out.top_logprobs
    for i, (token, value) in enumerate(zip(out.token_ids, log_probs, strict=False)):
        names = texts[i]
        value = max(value, _FLOOR)
        entries = [(names[0], value)]
        if tops is not None and i < len(tops):
            entries += [
                (names[j + 1], max(lp, _FLOOR))
                for j, (tid, lp) in enumerate(tops[i])
                if tid != token and j + 1 < len(names)
            ]
        yield names[0], value, entries


class ChoiceLogprobs:
    """The logprobs of one choice, chunk by chunk (streaming) or gathered (``full``).

    Args:
        top: alternatives per token the request asked for (chat ``top_logprobs``, completions
            ``logprobs``).
    """

    __slots__ = ("_content", "_offset", "_offsets", "_tokens", "_top", "_tops", "_values")

    def __init__(self, top: int) -> None:
        self._top = top
        self._offset = 0
        self._content: list[dict[str, Any]] = []
        self._tokens: list[str] = []
        self._values: list[float | None] = []  # None: an echoed prompt's first token
        self._tops: list[dict[str, float] | None] = []
        self._offsets: list[int] = []

    def chat(self, out: LLMEngineOutput) -> dict[str, Any]:
        """Chat's ``logprobs`` for the tokens of ``out`` (kept for ``chat_full`` too)."""
        content = [
            {
                "token": text,
                "logprob": value,
                "bytes": _bytes(text),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": _bytes(t)}
                    for t, lp in entries[: self._top]
                ],
            }
            for text, value, entries in _positions(out)
        ]
        self._content += content
        return {"content": content}

    def chat_full(self) -> dict[str, Any]:
        """Chat's ``logprobs`` of every chunk seen."""
        return {"content": self._content}

    def completion(self, out: LLMEngineOutput) -> dict[str, Any]:
        """Completions' ``logprobs`` for the tokens of ``out`` (``text_offset`` counts the
        token texts before, as vLLM's does)."""
        tokens: list[str] = []
        values: list[float] = []
        tops: list[dict[str, float]] = []
        offsets: list[int] = []
        for text, value, entries in _positions(out):
            tokens.append(text)
            values.append(value)
            tops.append(dict(entries))
            offsets.append(self._offset)
            self._offset += len(text)
        self._tokens += tokens
        self._values += values
        self._tops += tops
        self._offsets += offsets
        return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens,
                "top_logprobs": tops}

    def completion_prompt(self, out: LLMEngineOutput) -> dict[str, Any]:
        """Completions' ``logprobs`` of the prompt tokens (``echo``), from the output that
        carries ``prompt_logprobs``: the first token's logprob and alternatives are None, the
        others show their ``logprobs`` best plus the prompt token, as vLLM's server does."""
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        texts = out.prompt_logprob_texts or []
        for i, entries in enumerate(out.prompt_logprobs or ()):
            names = texts[i] if i < len(texts) else []
            text = names[0] if names else ""
            if not entries:
                values.append(None)
                tops.append(None)
            else:
                values.append(max(entries[0][1], _FLOOR))
                tops.append({names[j] if j < len(names) else "": max(lp, _FLOOR)
                             for j, (_, lp, _) in enumerate(entries[: self._top + 1])})
            tokens.append(text)
            offsets.append(self._offset)
            self._offset += len(text)
        self._tokens += tokens
        self._values += values
        self._tops += tops
        self._offsets += offsets
        return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens,
                "top_logprobs": tops}

    def completion_full(self) -> dict[str, Any]:
        """Completions' ``logprobs`` of every chunk seen."""
        return {"text_offset": self._offsets, "token_logprobs": self._values,
                "tokens": self._tokens, "top_logprobs": self._tops}


def requested_logprobs(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    """``OutputOptions.logprobs``: the top alternatives per token asked for (0: the sampled
    token's only), None when the request wants no logprobs."""
    if isinstance(req, CompletionRequest):
        return req.logprobs
    return (req.top_logprobs or 0) if req.logprobs else None


def asks_logprobs(req: ChatCompletionRequest | CompletionRequest) -> bool:
    """Whether the client asked for logprobs in its response."""
    if isinstance(req, ChatCompletionRequest):
        return bool(req.logprobs)
    return req.logprobs is not None
