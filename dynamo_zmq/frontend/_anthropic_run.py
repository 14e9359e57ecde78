"""A Messages API request's output side: its one sequence sent and read as ``FanOut`` reads a
chat request's (migration, deadline, disconnect, token metrics alike), answered as Anthropic's
SSE events or one ``message`` body (``_anthropic_blocks.py`` builds the content)."""

from __future__ import annotations

from typing import Any

import msgspec

from ..llm import FinishReason, LLMEngineOutput
from . import errors as http_errors
from ._anthropic_blocks import ContentBlocks, sse_event, stop_reason
from ._anthropic_errors import error_type
from ._asgi import JSON, SSE, Send, error, reply, send_message
from ._fanout import FanOut
from ._sse_chunks import Failed
from .errors import HttpError

__all__ = ["MessagesRun"]

_json = msgspec.json.encode


class MessagesRun(FanOut):
    """One Messages request's sequence (``FanOut`` with one sub-request), answered in the
    Messages API's shapes; ``message_id`` and ``served`` (the model name answered) are set
    before ``open``."""

    message_id = ""
    served = ""
    #: The request's stop strings: a matched one is ``stop_sequence``.
    stops: tuple[str, ...] = ()

    def _message(self, content: list[dict[str, Any]], reason: str | None,
                 sequence: str | None, usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant",
                "model": self.served, "content": content, "stop_reason": reason,
                "stop_sequence": sequence, "usage": usage}

    def _usage_body(self) -> dict[str, int]:
        prompt, completion, cached = self._usage()
        usage = {"input_tokens": prompt, "output_tokens": completion}
        if cached is not None:
            usage["cache_read_input_tokens"] = cached
        return usage

    def _finish(self, blocks: ContentBlocks, out: LLMEngineOutput) -> tuple[str, str | None]:
        if out.finish_reason == FinishReason.ERROR:
            raise Failed(http_errors.engine_error(out.error or "engine error"))
        sub = self.subs[0]
        sub.finish, sub.stop_reason = out.finish_reason, out.stop_reason
        matched = out.stop_reason if out.stop_reason in self.stops else None
        return stop_reason(out.finish_reason, matched, blocks.tool_use)

    async def _read(self, blocks: ContentBlocks,
                    send_events: Send | None) -> tuple[str, str | None]:
        """Read the sequence to its end into ``blocks`` (its events written to
        ``send_events`` as they come when streaming); its stop reason and sequence."""
        self._start_readers()
        while True:
            for sub, item in await self._next():
                if not isinstance(item, list):
                    raise Failed(self._failure(item))
                self._account(sub, item)
                for out in item:
                    blocks.add(out)
                    if out.finish_reason is not None:
                        blocks.close()
                        return self._finish(blocks, out)
            if send_events is not None and blocks.events:
                body = b"".join(blocks.events)
                blocks.events.clear()
                await send_message(send_events, {"type": "http.response.body", "body": body,
                                                 "more_body": True})

    async def stream_events(self, send: Send, headers: list[tuple[bytes, bytes]]) -> str:
        """Answer with Anthropic's event sequence; the status for the metrics."""
        await send_message(send, {"type": "http.response.start", "status": 200,
                                  "headers": SSE + headers})
        start = self._message([], None, None, {"input_tokens": self.prompt_tokens,
                                               "output_tokens": 0})
        first = sse_event({"type": "message_start", "message": start}) + sse_event(
            {"type": "ping"})
        await send_message(send, {"type": "http.response.body", "body": first,
                                  "more_body": True})
        blocks = ContentBlocks(streaming=True)
        try:
            reason, sequence = await self._read(blocks, send)
        except Failed as failed:
            exc: HttpError = failed.error
            blocks.events.append(sse_event({"type": "error", "error": {
                "type": error_type(exc.status), "message": exc.message}}))
            await send_message(send, {"type": "http.response.body",
                                      "body": b"".join(blocks.events), "more_body": False})
            return "error"
        blocks.events += [
            sse_event({"type": "message_delta",
                       "delta": {"stop_reason": reason, "stop_sequence": sequence},
                       "usage": self._usage_body()}),
            sse_event({"type": "message_stop"}),
        ]
        await send_message(send, {"type": "http.response.body", "body": b"".join(blocks.events),
                                  "more_body": False})
        return "success"

    async def respond_message(self, send: Send, headers: list[tuple[bytes, bytes]]) -> str:
        """Answer with one ``message`` body; the status for the metrics."""
        blocks = ContentBlocks(streaming=False)
        try:
            reason, sequence = await self._read(blocks, None)
        except Failed as failed:
            await error(send, failed.error)
            return "error"
        body = self._message(blocks.content(), reason, sequence, self._usage_body())
        await reply(send, 200, _json(body), JSON + headers)
        return "success"
