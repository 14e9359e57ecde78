"""``POST /v1/responses`` output side: the worker's outputs (text, and the reasoning and tool
calls its parsers made) as Responses output items and, streaming, as the API's typed SSE
events, each with its ``sequence_number``.

Items open in the order their outputs come: a ``reasoning`` item (``reasoning_text``
content), a ``message`` item (one ``output_text`` part) and a ``function_call`` item per call;
a different kind of output closes the open item. Events per item, as OpenAI sends them:
``response.output_item.added``, ``response.content_part.added``, the deltas
(``response.output_text.delta`` / ``response.reasoning_text.delta`` /
``response.function_call_arguments.delta``), their ``.done``, ``response.content_part.done``,
``response.output_item.done``; around them ``response.created``, ``response.in_progress`` and
``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut it short,
``response.failed`` with the error when it failed).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from ..llm import FinishReason, LLMEngineOutput, ToolCallDelta
from ._responses_request import ResponsesRequest
from .errors import HttpError

__all__ = ["ResponseBuilder"]

_json = msgspec.json.encode


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """One response's output items and (``streaming``) its pending SSE events."""

    def __init__(self, req: ResponsesRequest, model: str, streaming: bool) -> None:
        self.id = _id("resp")
        self.req, self.model, self.streaming = req, model, streaming
        self.created = int(time.time())
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._calls: dict[int, dict[str, Any]] = {}
        self._seq = 0
        self._events: list[bytes] = []
        self.status = "in_progress"
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.incomplete: dict[str, Any] | None = None
        self.reasoning_tokens = 0
        self.stored = False

    # -- events ----------------------------------------------------------------------------

    def _emit(self, kind: str, **fields: Any) -> None:
        if not self.streaming:
            return
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        self._events.append(b"event: " + kind.encode() + b"\ndata: " + _json(event) + b"\n\n")

    def take(self) -> bytes:
        """The events made since the last ``take``."""
        out, self._events = b"".join(self._events), []
        return out

    def start(self) -> None:
        self._emit("response.created", response=self.body())
        self._emit("response.in_progress", response=self.body())

    # -- items -----------------------------------------------------------------------------

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": item["_index"]}

    def _add(self, item: dict[str, Any], part: dict[str, Any] | None) -> dict[str, Any]:
        self._close()
        item["_index"] = len(self.output)
        self.output.append(item)
        self._open = item
        self._emit("response.output_item.added", output_index=item["_index"],
                   item=self._public(item))
        if part is not None:
            item["content"].append(part)
            self._emit("response.content_part.added", **self._where(item), content_index=0,
                       part=dict(part))
        return item

    @staticmethod
    def _public(item: dict[str, Any]) -> dict[str, Any]:
        public = {k: v for k, v in item.items() if not k.startswith("_")}
        if "content" in public:
            public["content"] = [dict(p) for p in public["content"]]
        return public

    def _close(self) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        item["status"] = "completed"
        where = self._where(item)
        if item["type"] == "function_call":
            self._emit("response.function_call_arguments.done", **where,
                       name=item["name"], arguments=item["arguments"])
        else:
            part = item["content"][0]
            if item["type"] == "message":
                self._emit("response.output_text.done", **where, content_index=0,
                           text=part["text"], logprobs=[])
            else:
                self._emit("response.reasoning_text.done", **where, content_index=0,
                           text=part["text"])
            self._emit("response.content_part.done", **where, content_index=0, part=dict(part))
        self._emit("response.output_item.done", output_index=item["_index"],
                   item=self._public(item))

    def _text(self, kind: str, text: str) -> None:
        item = self._open
        if item is None or item["type"] != kind:
            if kind == "message":
                item = self._add({"id": _id("msg"), "type": "message", "status": "in_progress",
                                  "role": "assistant", "content": []},
                                 {"type": "output_text", "text": "", "annotations": []})
            else:
                item = self._add({"id": _id("rs"), "type": "reasoning", "summary": [],
                                  "content": [], "status": "in_progress"},
                                 {"type": "reasoning_text", "text": ""})
        item["content"][0]["text"] += text
        if kind == "message":
            self._emit("response.output_text.delta", **self._where(item), content_index=0,
                       delta=text, logprobs=[])
        else:
            self._emit("response.reasoning_text.delta", **self._where(item), content_index=0,
                       delta=text)

    def _call(self, delta: ToolCallDelta) -> None:
        item = self._calls.get(delta.index)
        if item is None or delta.id is not None:
            item = self._add({"id": _id("fc"), "type": "function_call", "status": "in_progress",
                              "call_id": delta.id or _id("call"), "name": delta.name or "",
                              "arguments": ""}, None)
            self._calls[delta.index] = item
        if delta.arguments:
            item["arguments"] += delta.arguments
            self._emit("response.function_call_arguments.delta", **self._where(item),
                       delta=delta.arguments)

    def add(self, out: LLMEngineOutput) -> None:
        """One output of the worker: its reasoning, text and tool calls."""
        if out.reasoning:
            self._text("reasoning", out.reasoning)
            if not out.text and out.token_ids:
                self.reasoning_tokens += len(out.token_ids)
        if out.text:
            self._text("message", out.text)
        for delta in out.tool_calls or ():
            self._call(delta)

    # -- the end ---------------------------------------------------------------------------

    def finish(self, reason: str | None, prompt: int, completion: int,
               cached: int | None) -> None:
        """Close the open item and end the response (``response.completed``, or
        ``response.incomplete`` after ``length``)."""
        self._close()
        self.usage = {
            "input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached or 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": prompt + completion,
        }
        if reason == FinishReason.LENGTH:
            self.status = "incomplete"
            self.incomplete = {"reason": "max_output_tokens"}
            self._emit("response.incomplete", response=self.body())
        else:
            self.status = "completed"
            self._emit("response.completed", response=self.body())

    def fail(self, exc: HttpError) -> None:
        """End the response as failed (``response.failed`` carrying the error)."""
        self.status = "failed"
        self.error = {"code": exc.code or exc.type, "message": exc.message}
        self._emit("response.failed", response=self.body())

    def body(self) -> dict[str, Any]:
        """The Response object as it stands."""
        req = self.req
        fmt = (req.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": self.status, "error": self.error, "incomplete_details": self.incomplete,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.model, "output": [self._public(i) for i in self.output],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "reasoning": None,
            "store": self.stored, "temperature": req.temperature, "text": {"format": fmt},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
            "top_p": req.top_p, "truncation": "disabled", "usage": self.usage,
            "user": req.user, "metadata": req.metadata or {},
        }

    def assistant_message(self) -> dict[str, Any]:
        """The output as the chat conversation's next assistant message (for the store)."""
        text, thoughts, calls = [], [], []
        for item in self.output:
            if item["type"] == "message":
                text.append(item["content"][0]["text"])
            elif item["type"] == "reasoning":
                thoughts.append(item["content"][0]["text"])
            else:
                calls.append({"id": item["call_id"], "type": "function",
                              "function": {"name": item["name"],
                                           "arguments": item["arguments"]}})
        message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
        if calls:
            message["tool_calls"] = calls
        if thoughts:
            message["reasoning_content"] = "".join(thoughts)
        return message
