"""The OpenAI-compatible HTTP API as a raw ASGI application (no framework on the hot path).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming and not),
``GET /v1/models``, ``/health``, ``/live``, ``/metrics``. Each generation request is parsed and
preprocessed here (chat template, tokens, sampling and stop options), routed to a worker, and
its output deltas are formatted as OpenAI SSE chunks. A client that disconnects kills the
request's context, which reaches the worker and aborts the engine's sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from .. import errors
from ..context import Context
from ..llm import FinishReason, LLMEngineOutput
from ..transport import ResponseStream
from . import errors as http_errors
from .errors import HttpError
from .metrics import FrontendMetrics
from .models import ModelEntry, ModelManager
from .protocol import parse_chat, parse_completion
from .responses import DONE, ChatFormatter, CompletionFormatter, sse_error

__all__ = ["FrontendApp"]

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

MAX_BODY = 32 * 1024 * 1024
_decode_output = msgspec.msgpack.Decoder(LLMEngineOutput).decode
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class FrontendApp:
    """ASGI app. ``on_startup``/``on_shutdown`` run in the server's event loop (lifespan)."""

    def __init__(
        self,
        manager_factory: Callable[[], Awaitable[ModelManager]],
        on_shutdown: Callable[[], Awaitable[None]],
        request_timeout: float | None = None,
    ) -> None:
        self._manager_factory = manager_factory
        self._on_shutdown = on_shutdown
        self.timeout = request_timeout
        self.manager: ModelManager | None = None
        self.metrics = FrontendMetrics()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    self.manager = await self._manager_factory()
                except Exception as exc:
                    log.exception("frontend failed to start")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self._on_shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- routing ---------------------------------------------------------------------------

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        method, path = scope["method"], scope["path"]
        try:
            if path == "/v1/chat/completions" and method == "POST":
                await self._generate(receive, send, "chat")
            elif path == "/v1/completions" and method == "POST":
                await self._generate(receive, send, "completions")
            elif path == "/v1/models" and method == "GET":
                await _reply(send, 200, self._models())
            elif path in ("/health", "/live") and method == "GET":
                await self._health(send, path)
            elif path == "/metrics" and method == "GET":
                await _reply(send, 200, self.metrics.render(), [(b"content-type", b"text/plain; version=0.0.4")])
            elif path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/live", "/metrics"):
                await _error(send, HttpError(405, "invalid_request_error", f"{method} is not allowed on {path}"))
            else:
                await _error(send, http_errors.not_found(f"no route {path}"))
        except _ClientGone:
            pass

    def _models(self) -> bytes:
        assert self.manager is not None
        data = [
            {"id": m.name, "object": "model", "created": m.created, "owned_by": "dynamo-zmq"}
            for m in self.manager.live()
        ]
        return msgspec.json.encode({"object": "list", "data": data})

    async def _health(self, send: Send, path: str) -> None:
        if path == "/live":
            await _reply(send, 200, b'{"status":"live"}')
            return
        assert self.manager is not None
        live = self.manager.live()
        body = {
            "status": "healthy" if live else "no_workers",
            "models": {m.name: [f"{i:x}" for i in m.client.instance_ids()] for m in live},
        }
        await _reply(send, 200 if live else 503, msgspec.json.encode(body))

    # -- generation ------------------------------------------------------------------------

    async def _generate(self, receive: Receive, send: Send, endpoint: str) -> None:
        assert self.manager is not None
        try:
            body = await _read_body(receive)
            req = parse_chat(body) if endpoint == "chat" else parse_completion(body)
            entry = self.manager.get(req.model)
            if entry is None:
                raise http_errors.model_not_found(req.model)
            pre = entry.preprocessor.chat(req) if endpoint == "chat" else entry.preprocessor.completion(req)
            if not entry.client.instance_ids():
                raise http_errors.no_worker(f"no live worker serves model {req.model!r}")
        except HttpError as exc:
            self.metrics.requests.labels(getattr(exc, "model", ""), endpoint, "unknown", "error").inc()
            await _error(send, exc)
            return
        fmt = ChatFormatter(entry.name) if endpoint == "chat" else CompletionFormatter(entry.name)
        include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
        await self._run(receive, send, entry, pre, fmt, bool(req.stream), include_usage, endpoint)

    async def _run(
        self,
        receive: Receive,
        send: Send,
        entry: ModelEntry,
        pre: Any,
        fmt: ChatFormatter | CompletionFormatter,
        streaming: bool,
        include_usage: bool,
        endpoint: str,
    ) -> None:
        m, model = self.metrics, entry.name
        m.inflight.labels(model).inc()
        m.isl.labels(model).observe(len(pre.token_ids))
        ctx = Context(fmt.id)
        watcher = asyncio.create_task(_watch_disconnect(receive, ctx), name=f"disconnect-{fmt.id}")
        started = time.monotonic()
        run = _Run(self, entry, fmt, len(pre.token_ids), started)
        status = "error"
        try:
            try:
                stream = await entry.client.generate(pre, context=ctx, idle_timeout=self.timeout)
            except errors.DynamoError as exc:
                await _error(send, http_errors.from_dynamo(exc))
                return
            routed = getattr(stream, "routed_header", None)  # a KV router's choice
            if routed is not None:
                run.headers = [(b"x-dynamo-worker", routed)]
            if streaming:
                status = await run.stream_sse(stream, send, include_usage)
            else:
                status = await run.respond_once(stream, send)
        except _ClientGone:
            ctx.kill()
            status = "disconnected"
        finally:
            watcher.cancel()
            if status == "disconnected" or (ctx.is_killed() and status != "success"):
                m.disconnected.labels(model).inc()
                status = "disconnected"
            m.requests.labels(model, endpoint, "stream" if streaming else "unary", status).inc()
            m.inflight.labels(model).dec()
            m.duration.labels(model).observe(time.monotonic() - started)


class _Run:
    """One generation request's output loop (streamed or aggregated)."""

    def __init__(self, app: FrontendApp, entry: ModelEntry, fmt: Any, prompt_tokens: int, started: float) -> None:
        self.app = app
        self.entry = entry
        self.fmt = fmt
        self.prompt_tokens = prompt_tokens
        self.started = started
        self.last = started
        self.completion_tokens = 0
        self.usage_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.finish_reason: str | None = None
        self.first = True
        #: Extra response headers (``x-dynamo-worker`` in KV routing mode).
        self.headers: list[tuple[bytes, bytes]] = []

    def _account(self, out: LLMEngineOutput) -> str:
        """Update counters and metrics for one output; returns its text."""
        n = len(out.token_ids)
        if n:
            now = time.monotonic()
            ttft, itl = self.app.metrics.token_metrics(self.entry.name)
            if self.first:
                ttft.observe(now - self.started)
                self.first = False
            else:
                itl.observe((now - self.last) / n)
            self.last = now
            self.completion_tokens += n
        if out.usage is not None:
            self.usage_tokens = out.usage.completion_tokens
            self.cached_tokens = out.usage.cached_tokens
        if out.text is not None:
            return out.text
        if n:  # a worker without post-processing: decode here
            return self.entry.preprocessor.tokenizer.decode(out.token_ids)
        return ""

    def _finish(self) -> None:
        tokens = self.usage_tokens if self.usage_tokens is not None else self.completion_tokens
        self.app.metrics.osl.labels(self.entry.name).observe(tokens)

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.completion_tokens

    async def stream_sse(self, stream: Any, send: Send, include_usage: bool) -> str:
        fmt = self.fmt
        headers = _SSE + self.headers if self.headers else _SSE
        await _send(send, {"type": "http.response.start", "status": 200, "headers": headers})
        head = fmt.role_chunk()
        while True:
            try:
                first = await stream.__anext__()
            except StopAsyncIteration:
                err: HttpError | None = http_errors.engine_error("the worker ended the stream without a finish")
            except errors.Cancelled:
                raise _ClientGone from None
            except errors.DynamoError as exc:
                err = http_errors.from_dynamo(exc)
            else:
                err = None
            if err is not None:
                body = head + sse_error(err.to_json()) + DONE
                await _send(send, {"type": "http.response.body", "body": body, "more_body": False})
                return "error"
            parts = [head] if head else []
            head = b""
            item = first
            while item is not ResponseStream.EMPTY:
                out = _decode_output(item.payload)
                text = self._account(out)
                if text:
                    parts.append(fmt.content_chunk(text))
                if out.finish_reason is not None:
                    return await self._end_sse(out, parts, send, include_usage)
                item = stream.next_nowait()
            await _send(send, {"type": "http.response.body", "body": b"".join(parts), "more_body": True})

    async def _end_sse(self, out: LLMEngineOutput, parts: list[bytes], send: Send, include_usage: bool) -> str:
        self._finish()
        if out.finish_reason == FinishReason.ERROR:
            parts.append(sse_error(http_errors.engine_error(out.error or "engine error").to_json()))
            status = "error"
        else:
            parts.append(self.fmt.finish_chunk(_openai_reason(out.finish_reason)))
            if include_usage:
                parts.append(self.fmt.usage_chunk(self.prompt_tokens, self.tokens, self.cached_tokens))
            status = "success"
        parts.append(DONE)
        await _send(send, {"type": "http.response.body", "body": b"".join(parts), "more_body": False})
        return status

    async def respond_once(self, stream: Any, send: Send) -> str:
        texts: list[str] = []
        try:
            async for item in stream:
                out = _decode_output(item.payload)
                texts.append(self._account(out))
                if out.finish_reason is not None:
                    self.finish_reason = out.finish_reason
                    if out.finish_reason == FinishReason.ERROR:
                        raise http_errors.engine_error(out.error or "engine error")
                    break
        except errors.Cancelled:
            raise _ClientGone from None
        except errors.DynamoError as exc:
            await _error(send, http_errors.from_dynamo(exc))
            return "error"
        except HttpError as exc:
            await _error(send, exc)
            return "error"
        if self.finish_reason is None:
            await _error(send, http_errors.engine_error("the worker ended the stream without a finish"))
            return "error"
        self._finish()
        body = self.fmt.full(
            "".join(texts), _openai_reason(self.finish_reason), self.prompt_tokens, self.tokens, self.cached_tokens
        )
        await _reply(send, 200, body, _JSON + self.headers if self.headers else None)
        return "success"


class _ClientGone(Exception):
    """The HTTP client disconnected; nothing more can be sent."""


def _openai_reason(reason: str | None) -> str:
    return "length" if reason == FinishReason.LENGTH else "stop"


async def _watch_disconnect(receive: Receive, ctx: Context) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            ctx.kill()
            return


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        body = message.get("body", b"")
        size += len(body)
        if size > MAX_BODY:
            raise HttpError(413, "invalid_request_error", f"request body larger than {MAX_BODY} bytes", code="request_too_large")
        chunks.append(body)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _send(send: Send, message: dict[str, Any]) -> None:
    try:
        await send(message)
    except (OSError, RuntimeError) as exc:  # the connection is gone
        raise _ClientGone from exc


async def _reply(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await _send(send, {"type": "http.response.start", "status": status, "headers": headers or _JSON})
    await _send(send, {"type": "http.response.body", "body": body, "more_body": False})


async def _error(send: Send, exc: HttpError) -> None:
    with contextlib.suppress(_ClientGone):
        await _reply(send, exc.status, exc.to_json())
