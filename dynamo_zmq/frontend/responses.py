"""OpenAI response bodies: SSE chunks as OpenAI sends them, and aggregated responses.

Chunks are built from pre-encoded byte templates; only the text of each delta is JSON-encoded
per token (msgspec), which keeps the per-chunk cost at a few microseconds.

Finish reasons become OpenAI's as Dynamo's OpenAI layer maps its ``FinishReason``
(``OPENAI_FINISH_REASONS``): ``eos``, ``stop`` and ``cancelled`` -> ``"stop"``, ``length`` ->
``"length"``, ``tool_calls`` (the worker parsed a tool call) -> ``"tool_calls"``; ``error`` is
no finish reason but an error (the frontend sends an OpenAI error
object instead). The finish chunk and the aggregated choice also carry vLLM's ``stop_reason``:
the stop string or stop token id that matched, null otherwise.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from ..llm import FinishReason, ToolCallDelta

__all__ = [
    "DONE",
    "OPENAI_FINISH_REASONS",
    "ChatFormatter",
    "CompletionFormatter",
    "add_tool_call",
    "openai_finish_reason",
    "sse_error",
]

DONE = b"data: [DONE]\n\n"

_json = msgspec.json.encode

#: Our finish reason -> OpenAI's ``finish_reason`` (Dynamo's ``FinishReason`` -> async-openai
#: conversion). ``error`` is absent: it is answered as an error, not as a finish.
OPENAI_FINISH_REASONS = {
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "stop",
    FinishReason.TOOL_CALLS: "tool_calls",
}


def openai_finish_reason(reason: str) -> str:
    """OpenAI's ``finish_reason`` for a terminal output's (``"stop"`` for one it does not
    know, as Dynamo reads an unknown reason as a stop)."""
    return OPENAI_FINISH_REASONS.get(reason, "stop")


def _usage(prompt: int, completion: int, cached: int | None = None) -> dict[str, object]:
    usage: dict[str, object] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if cached is not None:  # prompt tokens the engine served from its prefix cache (as OpenAI)
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def _call(delta: ToolCallDelta) -> dict[str, Any]:
    if delta.id is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    return {"index": delta.index, "id": delta.id, "type": "function",
            "function": {"name": delta.name, "arguments": delta.arguments}}


def add_tool_call(calls: dict[int, dict[str, Any]], delta: ToolCallDelta) -> None:
    """Gather a stream's tool-call deltas into whole calls (``message.tool_calls``)."""
    call = calls.get(delta.index)
    if call is None or delta.id is not None:
        calls[delta.index] = _call(delta)
    else:
        call["function"]["arguments"] += delta.arguments


def sse_error(body: bytes) -> bytes:
    """An error inside an already-started stream (the body is an OpenAI error object)."""
    return b"data: " + body + b"\n\n"


class _Formatter:
    object_chunk = b""
    object_full = ""
    id_prefix = ""
    #: ``stream_options.continuous_usage_stats`` (with ``include_usage``): every chunk carries
    #: the usage so far (``with_usage``), as vLLM's server does.
    continuous_usage = False
    #: The request's logprobs (``OutputOptions.logprobs``: alternatives per token; None: none
    #: asked for): chunks then carry them (``logprobs_chunk``).
    logprobs: int | None = None

    def __init__(self, model: str) -> None:
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self._head = (
            b'data: {"id":' + _json(self.id) + b',"object":"' + self.object_chunk + b'","created":'
            + str(self.created).encode() + b',"model":' + _json(model) + b',"choices":['
        )

    def usage_chunk(self, prompt: int, completion: int, cached: int | None = None) -> bytes:
        return self._head + b'],"usage":' + _json(_usage(prompt, completion, cached)) + b"}\n\n"

    @staticmethod
    def with_usage(chunk: bytes, prompt: int, completion: int) -> bytes:
        """``chunk`` (one ``data: {...}`` event) with a ``usage`` field: the tokens so far."""
        return chunk[:-3] + b',"usage":' + _json(_usage(prompt, completion, None)) + b"}\n\n"

    def _at(self, index: int) -> bytes:
        """A chunk's start up to its choice's ``index`` (several choices: ``n``, batches)."""
        return self._head + b'{"index":' + str(index).encode()

    def choice(
        self,
        index: int,
        text: str,
        finish_reason: str,
        stop_reason: int | str | None,
        logprobs: dict[str, Any] | None = None,
        *,
        reasoning: str | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, object]:
        """One choice of an aggregated response (``reasoning`` and ``tool_calls``: chat's)."""
        raise NotImplementedError

    def full_choices(
        self,
        choices: list[dict[str, object]],
        prompt: int,
        completion: int,
        cached: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> bytes:
        """The aggregated response with ``choices`` (from ``choice``, in index order), and
        ``extra`` fields (chat's ``prompt_logprobs``)."""
        body: dict[str, Any] = {
            "id": self.id,
            "object": self.object_full,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": _usage(prompt, completion, cached),
        }
        if extra:
            body.update(extra)
        return _json(body)

    def full(
        self,
        text: str,
        finish_reason: str,
        prompt: int,
        completion: int,
        cached: int | None = None,
        *,
        stop_reason: int | str | None = None,
        logprobs: dict[str, Any] | None = None,
        reasoning: str | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> bytes:
        """The aggregated response of one choice."""
        choice = self.choice(
            0, text, finish_reason, stop_reason, logprobs, reasoning=reasoning,
            tool_calls=tool_calls,
        )
        return self.full_choices([choice], prompt, completion, cached)


class ChatFormatter(_Formatter):
    """``chat.completion.chunk`` events and the ``chat.completion`` body."""

    object_chunk = b"chat.completion.chunk"
    object_full = "chat.completion"
    id_prefix = "chatcmpl-"

    def role_chunk(self, index: int = 0) -> bytes:
        return (
            self._at(index)
            + b',"delta":{"role":"assistant","content":""},'
            b'"logprobs":null,"finish_reason":null}]}\n\n'
        )

    def reasoning_chunk(self, text: str, index: int = 0) -> bytes:
        """A ``delta.reasoning_content`` chunk (vLLM's field)."""
        return (
            self._at(index) + b',"delta":{"reasoning_content":' + _json(text)
            + b'},"logprobs":null,"finish_reason":null}]}\n\n'
        )

    def tool_calls_chunk(self, calls: list[ToolCallDelta], index: int = 0) -> bytes:
        """A ``delta.tool_calls`` chunk: a call's first delta has its id, type and name."""
        return (
            self._at(index) + b',"delta":{"tool_calls":' + _json([_call(c) for c in calls])
            + b'},"logprobs":null,"finish_reason":null}]}\n\n'
        )

    def logprobs_chunk(self, text: str, logprobs: dict[str, Any], index: int = 0) -> bytes:
        """A content chunk with the logprobs of its tokens (``ChoiceLogprobs.chat``)."""
        return (
            self._at(index) + b',"delta":{"content":' + _json(text)
            + b'},"logprobs":' + _json(logprobs) + b',"finish_reason":null}]}\n\n'
        )

    def content_chunk_at(self, index: int, text: str) -> bytes:
        """A content chunk of choice ``index``."""
        return (
            self._at(index) + b',"delta":{"content":' + _json(text)
            + b'},"logprobs":null,"finish_reason":null}]}\n\n'
        )

    def finish_chunk(
        self, finish_reason: str, stop_reason: int | str | None = None, index: int = 0
    ) -> bytes:
        return (
            self._at(index) + b',"delta":{},"logprobs":null,"finish_reason":'
            + _json(finish_reason) + b',"stop_reason":' + _json(stop_reason) + b"}]}\n\n"
        )

    def choice(
        self,
        index: int,
        text: str,
        finish_reason: str,
        stop_reason: int | str | None,
        logprobs: dict[str, Any] | None = None,
        *,
        reasoning: str | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, object]:
        message: dict[str, Any] = {
            "role": "assistant", "content": text if text or not tool_calls else None,
        }
        if tool_calls:
            message["tool_calls"] = tool_calls
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return {
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }


class CompletionFormatter(_Formatter):
    """``text_completion`` events and body."""

    object_chunk = b"text_completion"
    object_full = "text_completion"
    id_prefix = "cmpl-"

    def role_chunk(self, index: int = 0) -> bytes:
        return b""

    def logprobs_chunk(self, text: str, logprobs: dict[str, Any], index: int = 0) -> bytes:
        """A text chunk with the logprobs of its tokens (``ChoiceLogprobs.completion``)."""
        return (
            self._at(index) + b',"text":' + _json(text)
            + b',"logprobs":' + _json(logprobs) + b',"finish_reason":null}]}\n\n'
        )

    def content_chunk_at(self, index: int, text: str) -> bytes:
        """A content chunk of choice ``index``."""
        return (
            self._at(index) + b',"text":' + _json(text)
            + b',"logprobs":null,"finish_reason":null}]}\n\n'
        )

    def finish_chunk(
        self, finish_reason: str, stop_reason: int | str | None = None, index: int = 0
    ) -> bytes:
        return (
            self._at(index) + b',"text":"","logprobs":null,"finish_reason":'
            + _json(finish_reason) + b',"stop_reason":' + _json(stop_reason) + b"}]}\n\n"
        )

    def choice(
        self,
        index: int,
        text: str,
        finish_reason: str,
        stop_reason: int | str | None,
        logprobs: dict[str, Any] | None = None,
        *,
        reasoning: str | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, object]:
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }
