"""A Messages API response's content blocks, built from the worker's outputs.

The worker's parsers split a generation into reasoning (``LLMEngineOutput.reasoning``), text and
tool-call deltas (``tool_calls``); ``ContentBlocks`` turns them, in the order they come, into
Anthropic's blocks: ``thinking``, ``text`` and ``tool_use`` (a call's first delta, with its id
and name, opens one; its argument pieces are its ``input`` JSON). Streaming, each block is
written as ``content_block_start``, ``content_block_delta`` (``thinking_delta``,
``text_delta``, ``input_json_delta``) and ``content_block_stop`` events; aggregated, as the
message's ``content`` list. ``stop_reason`` maps our finish reasons to Anthropic's.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from ..llm import FinishReason, LLMEngineOutput

__all__ = ["ContentBlocks", "sse_event", "stop_reason"]

_json = msgspec.json.encode


def sse_event(body: dict[str, Any]) -> bytes:
    """One server-sent event named after its body's ``type``."""
    kind: str = body["type"]
    return b"event: " + kind.encode() + b"\ndata: " + _json(body) + b"\n\n"


def stop_reason(finish: str | None, matched: int | str | None,
                tool_use: bool) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a finished sequence: ``tool_use``
    (the worker parsed a tool call), ``max_tokens`` (length), ``stop_sequence`` with the stop
    string that matched, ``end_turn`` otherwise (end of sequence, a stop token, a cancel)."""
    if finish == FinishReason.TOOL_CALLS or tool_use:
        return "tool_use", None
    if finish == FinishReason.LENGTH:
        return "max_tokens", None
    if finish == FinishReason.STOP and isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def _input(arguments: str) -> Any:
    """A call's arguments as its ``input`` object (arguments cut short: what there is, as a
    string under ``"arguments"``, rather than lost)."""
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


class ContentBlocks:
    """The blocks of one response; ``events`` collects their SSE events when streaming."""

    def __init__(self, streaming: bool) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._streaming = streaming
        self._open: str | None = None
        self._args: dict[int, str] = {}
        self.events: list[bytes] = []
        self.tool_use = False

    def _start(self, kind: str, block: dict[str, Any]) -> None:
        self.close()
        self._open = kind
        self.blocks.append(block)
        if self._streaming:
            self.events.append(sse_event({"type": "content_block_start",
                                          "index": len(self.blocks) - 1,
                                          "content_block": block}))

    def _delta(self, delta: dict[str, Any]) -> None:
        if self._streaming:
            self.events.append(sse_event({"type": "content_block_delta",
                                          "index": len(self.blocks) - 1, "delta": delta}))

    def close(self) -> None:
        """End the open block (``content_block_stop``)."""
        if self._open is not None and self._streaming:
            self.events.append(sse_event({"type": "content_block_stop",
                                          "index": len(self.blocks) - 1}))
        self._open = None

    def add(self, out: LLMEngineOutput) -> None:
        """One output's reasoning, text and tool-call pieces."""
        if out.reasoning:
            if self._open != "thinking":
                self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self._delta({"type": "thinking_delta", "thinking": out.reasoning})
            if not self._streaming:
                self.blocks[-1]["thinking"] += out.reasoning
        if out.text:
            if self._open != "text":
                self._start("text", {"type": "text", "text": ""})
            self._delta({"type": "text_delta", "text": out.text})
            if not self._streaming:
                self.blocks[-1]["text"] += out.text
        for call in out.tool_calls or ():
            if call.id is not None or self._open != f"tool{call.index}":
                self.tool_use = True
                self._start(f"tool{call.index}", {"type": "tool_use", "id": call.id or "",
                                                  "name": call.name or "", "input": {}})
                self._args[len(self.blocks) - 1] = ""
            if call.arguments:
                self._delta({"type": "input_json_delta", "partial_json": call.arguments})
                self._args[len(self.blocks) - 1] += call.arguments

    def content(self) -> list[dict[str, Any]]:
        """The aggregated ``content``: tool inputs parsed, whitespace-only text left out."""
        out = []
        for i, block in enumerate(self.blocks):
            if block["type"] == "tool_use":
                block = {**block, "input": _input(self._args.get(i, ""))}
            elif block["type"] == "text" and not block["text"].strip():
                continue
            out.append(block)
        return out
