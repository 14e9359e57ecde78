"""One generation request's output loop: the worker's outputs as OpenAI SSE chunks (streaming)
or one JSON body (not), with the frontend's token metrics.

The outputs arrive decoded from the model's router (``OutputStream``), their text already made
by the worker's post-processing; what arrived together is written in one send.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .. import errors
from ..llm import FinishReason, LLMEngineOutput, Migration, OutputStream
from . import errors as http_errors
from ._asgi import JSON, SSE, ClientGone, Send, error, reply, send_message
from ._deadline import Deadline
from ._logprobs import ChoiceLogprobs
from .errors import HttpError
from .metrics import FrontendMetrics
from .responses import (
    DONE,
    ChatFormatter,
    CompletionFormatter,
    add_tool_call,
    openai_finish_reason,
    sse_error,
)

__all__ = ["Generation"]

_NO_FINISH = "the worker ended the stream without a finish"


class Generation:
    """The output side of one request (streamed or aggregated).

    Args:
        metrics: the frontend's metrics.
        model: the served model name (metrics label).
        fmt: the chat or completion chunk formatter.
        prompt_tokens: the prompt's length (usage).
        started: when the request arrived (``time.monotonic()``), for time to first token.
        headers: extra response headers (``x-dynamo-worker``).
        deadline: the request's whole-request deadline, if it has one: a stream it cut short
            ends with 504 (or an SSE error event), not as a client that went away.
        migration: the request's migration (None: off): the token ids of each output read are
            added to it, and a stream that fails goes on from the stream it recovers, if it can.
        parsed: the worker parses tool calls or reasoning (chat): outputs carry them too.
    """

    def __init__(
        self,
        metrics: FrontendMetrics,
        model: str,
        fmt: ChatFormatter | CompletionFormatter,
        prompt_tokens: int,
        started: float,
        headers: list[tuple[bytes, bytes]],
        deadline: Deadline | None = None,
        migration: Migration | None = None,
        parsed: bool = False,
    ) -> None:
        self.metrics = metrics
        #: The worker parses tool calls or reasoning for this (chat) request.
        self.parsed = parsed and isinstance(fmt, ChatFormatter)
        self.migration = migration
        self.deadline = deadline
        self.model = model
        self.fmt = fmt
        self.prompt_tokens = prompt_tokens
        self.started = started
        self.last = started
        self.headers = headers
        self.completion_tokens = 0
        self.usage_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.first = True
        #: The choice's logprobs, when the request asked for them.
        self.choice_logprobs: ChoiceLogprobs | None = None

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.completion_tokens

    def _account(self, out: LLMEngineOutput) -> str:
        """Update counters and metrics for one output; returns its text."""
        n = len(out.token_ids)
        if n:
            now = time.monotonic()
            ttft, itl = self.metrics.token_metrics(self.model)
            if self.first:
                ttft.observe(now - self.started)
                self.first = False
                if self.migration is not None:  # what a migration's trace links to
                    self.migration.link = out.worker_trace_link
            else:
                itl.observe((now - self.last) / n)
            self.last = now
            self.completion_tokens += n
        if out.usage is not None:
            self.usage_tokens = out.usage.completion_tokens
            self.cached_tokens = out.usage.cached_tokens
        return out.text or ""

    def _finish(self) -> None:
        self.metrics.osl.labels(self.model).observe(self.tokens)

    async def stream_sse(self, stream: OutputStream, send: Send, include_usage: bool) -> str:
        """Write the outputs as SSE chunks; returns the request's status for the metrics."""
        fmt = self.fmt
        start = {"type": "http.response.start", "status": 200, "headers": SSE + self.headers}
        await send_message(send, start)
        head = fmt.role_chunk()
        record = self.migration.generated.extend if self.migration is not None else None
        continuous = fmt.continuous_usage
        take = self._logprobs()
        parsed = self.parsed
        if continuous:
            head = fmt.with_usage(head, self.prompt_tokens, 0)
        while True:
            err: HttpError | None = None
            try:
                batch = await stream.next_batch()
            except errors.Cancelled:
                err = self._timed_out()
            except errors.DynamoError as exc:
                recovered = await self._recover(stream, exc)
                if not isinstance(recovered, HttpError):
                    stream = recovered
                    continue
                err = recovered
            else:
                if not batch:
                    err = http_errors.engine_error(_NO_FINISH)
            if err is not None:
                body = head + sse_error(err.to_json()) + DONE
                await send_message(send, {"type": "http.response.body", "body": body,
                                          "more_body": False})
                return "error"
            parts = [head] if head else []
            head = b""
            for out in batch:
                if record is not None:
                    record(out.token_ids)
                text = self._account(out)
                if parsed:
                    self._parsed_chunks(out, text, parts, take)
                elif take is not None and out.log_probs:
                    chunk = fmt.logprobs_chunk(text, take(out))
                    if continuous:
                        chunk = fmt.with_usage(chunk, self.prompt_tokens, self.completion_tokens)
                    parts.append(chunk)
                elif text:
                    chunk = fmt.content_chunk(text)
                    if continuous:
                        chunk = fmt.with_usage(chunk, self.prompt_tokens, self.completion_tokens)
                    parts.append(chunk)
                if out.finish_reason is not None:
                    return await self._end_sse(out, parts, send, include_usage)
            body = b"".join(parts)
            await send_message(
                send, {"type": "http.response.body", "body": body, "more_body": True}
            )

    def _parsed_chunks(
        self,
        out: LLMEngineOutput,
        text: str,
        parts: list[bytes],
        take: Callable[[LLMEngineOutput], dict[str, Any]] | None,
    ) -> None:
        """An output's reasoning, content and tool-call chunks, in that order (the logprobs
        of all its tokens, when asked for, ride on the content chunk)."""
        fmt = self.fmt
        assert isinstance(fmt, ChatFormatter)
        chunks = []
        if out.reasoning:
            chunks.append(fmt.reasoning_chunk(out.reasoning))
        if take is not None and out.log_probs:
            chunks.append(fmt.logprobs_chunk(text, take(out)))
        elif text:
            chunks.append(fmt.content_chunk(text))
        if out.tool_calls:
            chunks.append(fmt.tool_calls_chunk(out.tool_calls))
        for chunk in chunks:
            if fmt.continuous_usage:
                chunk = fmt.with_usage(chunk, self.prompt_tokens, self.completion_tokens)
            parts.append(chunk)

    async def _end_sse(
        self, out: LLMEngineOutput, parts: list[bytes], send: Send, include_usage: bool
    ) -> str:
        self._finish()
        if out.finish_reason == FinishReason.ERROR:
            parts.append(sse_error(http_errors.engine_error(out.error or "engine error").to_json()))
            status = "error"
        else:
            reason = openai_finish_reason(out.finish_reason or FinishReason.STOP)
            chunk = self.fmt.finish_chunk(reason, out.stop_reason)
            if self.fmt.continuous_usage:
                chunk = self.fmt.with_usage(chunk, self.prompt_tokens, self.tokens)
            parts.append(chunk)
            if include_usage:
                parts.append(
                    self.fmt.usage_chunk(self.prompt_tokens, self.tokens, self.cached_tokens)
                )
            status = "success"
        parts.append(DONE)
        body = b"".join(parts)
        await send_message(send, {"type": "http.response.body", "body": body, "more_body": False})
        return status

    async def respond_once(self, stream: OutputStream, send: Send) -> str:
        """Gather the outputs into one JSON response; returns the status for the metrics."""
        texts: list[str] = []
        thoughts: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        finish_reason: str | None = None
        stop_reason: int | str | None = None
        failure: str | None = None
        record = self.migration.generated.extend if self.migration is not None else None
        take = self._logprobs()
        while finish_reason is None:
            try:
                batch = await stream.next_batch()
            except errors.Cancelled:
                await error(send, self._timed_out())
                return "error"
            except errors.DynamoError as exc:
                recovered = await self._recover(stream, exc)
                if isinstance(recovered, HttpError):
                    await error(send, recovered)
                    return "error"
                stream = recovered
                continue
            if not batch:
                break
            for out in batch:
                if record is not None:
                    record(out.token_ids)
                texts.append(self._account(out))
                if take is not None:
                    take(out)
                if self.parsed:
                    if out.reasoning:
                        thoughts.append(out.reasoning)
                    for delta in out.tool_calls or ():
                        add_tool_call(calls, delta)
                if out.finish_reason is not None:
                    finish_reason, stop_reason, failure = (
                        out.finish_reason, out.stop_reason, out.error
                    )
                    break
        if finish_reason == FinishReason.ERROR:
            await error(send, http_errors.engine_error(failure or "engine error"))
            return "error"
        if finish_reason is None:
            await error(send, http_errors.engine_error(_NO_FINISH))
            return "error"
        self._finish()
        body = self.fmt.full(
            "".join(texts), openai_finish_reason(finish_reason), self.prompt_tokens, self.tokens,
            self.cached_tokens, stop_reason=stop_reason,
            logprobs=None if self.choice_logprobs is None else self._gathered(),
            reasoning="".join(thoughts) if thoughts else None,
            tool_calls=[calls[i] for i in sorted(calls)] or None,
        )
        await reply(send, 200, body, JSON + self.headers)
        return "success"

    def _logprobs(self) -> Callable[[LLMEngineOutput], dict[str, Any]] | None:
        """What turns an output into its choice's ``logprobs`` (None: not asked for)."""
        if self.fmt.logprobs is None:
            return None
        lp = self.choice_logprobs = ChoiceLogprobs(self.fmt.logprobs)
        return lp.chat if isinstance(self.fmt, ChatFormatter) else lp.completion

    def _gathered(self) -> dict[str, Any]:
        lp = self.choice_logprobs
        assert lp is not None
        return lp.chat_full() if isinstance(self.fmt, ChatFormatter) else lp.completion_full()

    async def _recover(
        self, stream: OutputStream, exc: errors.DynamoError
    ) -> OutputStream | HttpError:
        """After ``stream`` failed with ``exc``: the stream its request goes on from (migrated
        to another worker), or the error the client gets."""
        if self.migration is not None:
            try:
                return await self.migration.recover(stream, exc)
            except errors.Cancelled:
                return self._timed_out()
            except errors.DynamoError as final:
                exc = final
        return http_errors.from_dynamo(exc)

    def _timed_out(self) -> HttpError:
        """The error for a stream that ended ``Cancelled``: the deadline's 504 if it was the
        deadline; otherwise the client went away (``ClientGone``: nothing to send)."""
        if self.deadline is None or not self.deadline.expired:
            raise ClientGone from None
        return self.deadline.error()
