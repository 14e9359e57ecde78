"""The OpenAI-compatible HTTP API as a raw ASGI application (no framework on the hot path).

Routes (the table of ``_routes.py``): ``POST /v1/chat/completions``, ``POST /v1/completions``
(streaming and not), ``POST /v1/embeddings`` (``_embeddings.py``), ``/v1/responses``
(``_responses_api.py``), Anthropic's ``POST /v1/messages`` and ``/v1/messages/count_tokens``
(``_messages.py``), the Batch API's ``/v1/files`` and ``/v1/batches``
(``_batch_routes.py``), ``GET /v1/models``, ``/health``, ``/live``, ``/metrics``, Dynamo's
``POST /clear_kv_blocks`` (``_clear_kv.py``), and vLLM's
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (``_lora.py``; a request whose
``model`` is an adapter goes only to the workers holding it). Each generation
request is parsed and preprocessed here (chat template, tokens, sampling and stop options),
routed to a worker, and its output deltas are formatted as OpenAI SSE chunks; a request of
several sequences (``n``, ``best_of``, ``echo``, a batch of prompts) fans out into sub-requests
(``_fanout.py``). A client that disconnects kills the request's context, which reaches the
worker and aborts the engine's sequence; so does the request's deadline (``--request-timeout``
or the
``x-dynamo-request-timeout`` header), and the client then gets 504. With ``--tenant-limits``
each chat, completions and embeddings request is admitted for its tenant, and settled when it
ends (``_tenants.py``).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable

from ..llm import (
    DEFAULT_MIGRATION_LIMIT,
    Capability,
    Migration,
    PreprocessedRequest,
    RouteOptions,
)
from . import errors as http_errors
from ._admin_routes import serve_clear_kv_blocks, serve_lora_adapter
from ._anthropic_errors import MESSAGES_ROUTES
from ._asgi import (
    ClientGone,
    Receive,
    Scope,
    Send,
    error,
    read_body,
    reply,
)
from ._batch_routes import PREFIXES as BATCH_PREFIXES
from ._batch_routes import serve_batch_api
from ._batch_runner import BatchRunner
from ._deadline import request_timeout
from ._direct import WORKER_HEADER, direct_target
from ._embed_protocol import parse_embedding
from ._embeddings import embedding_requests, serve_embeddings
from ._fanout import FanOut
from ._health import health, models_body
from ._images import MediaPolicy, load_images
from ._limits import HttpLimits, Offload, Rejections, prompt_chars, text_chars
from ._logprobs import asks_logprobs
from ._lora import LoraRoutes, resolve_model
from ._messages import serve_messages
from ._priority import header_priority
from ._responses_api import PREFIX, create_response, stored_response
from ._responses_store import ResponsesStore
from ._routes import refuse, route_of
from ._scope import InFlight, RequestScope
from ._sessions import session_id
from ._subrequests import SubRequest, chat_work, completion_work
from ._tenants import Tenants, Ticket
from .errors import HttpError
from .metrics import FrontendMetrics
from .models import ModelEntry, ModelManager
from .protocol import ChatCompletionRequest, CompletionRequest, parse_chat, parse_completion
from .responses import ChatFormatter, CompletionFormatter

__all__ = ["WORKER_HEADER", "FrontendApp"]

log = logging.getLogger(__name__)

#: Response header: the instance (and data-parallel rank, when chosen) that served the request.
SERVED_BY_HEADER = b"x-dynamo-worker"
_METRICS_TYPE = [(b"content-type", b"text/plain; version=0.0.4")]


class FrontendApp:
    """ASGI app. ``on_startup``/``on_shutdown`` run in the server's event loop (lifespan).

    Args:
        manager_factory: builds the model table (at startup).
        on_shutdown: releases what the factory built.
        request_timeout: seconds a whole request may take (504 after; None: no deadline).
        idle_timeout: seconds to wait for a worker's next output (504 after; None: forever).
        migration_limit: how many times a request may move to another worker mid-stream
            (``llm.Migration``; 0: never); a model's workers may advertise their own.
        stall_timeout: seconds a stream may bring nothing before it is lost and migrates
            (``Migration.arm``; None: never).
        limits: body size and body-read timeout (``_limits.HttpLimits``).
        lora_placement: workers a LoRA adapter is loaded on (0: all of its model's).
    """

    def __init__(
        self,
        manager_factory: Callable[[], Awaitable[ModelManager]],
        on_shutdown: Callable[[], Awaitable[None]],
        request_timeout: float | None = None,
        idle_timeout: float | None = None,
        migration_limit: int = DEFAULT_MIGRATION_LIMIT,
        limits: HttpLimits | None = None,
        stall_timeout: float | None = None,
        lora_placement: int = 0,
    ) -> None:
        self._manager_factory = manager_factory
        self.lora_placement = lora_placement
        self.lora: LoraRoutes | None = None
        self._on_shutdown = on_shutdown
        self.timeout = request_timeout
        self.idle_timeout = idle_timeout
        self.migration_limit = migration_limit
        self.stall_timeout = stall_timeout
        self.manager: ModelManager | None = None
        self.metrics = FrontendMetrics()
        self.limits = limits or HttpLimits()
        self.offload = Offload()
        self._rejections = Rejections(self.metrics)
        #: The requests open now: the shutdown ends those still open when its grace is over.
        self.in_flight = InFlight()
        #: What ``/metrics`` answers when not this process's own page (``--http-workers``:
        #: every child's, ``_sibling_metrics.py``).
        self.metrics_page: Callable[[], Awaitable[bytes]] | None = None
        #: Per-tenant limits (``--tenant-limits``; None: none).
        self.tenants: Tenants | None = None
        #: The Responses API's stored responses (``--responses-store-size`` / ``-ttl``).
        self.responses = ResponsesStore()
        #: Where images may come from, and their sizes (``--allowed-media-domains``, ...).
        self.media = MediaPolicy()
        #: The Batch API's files and batches (None: off, as with ``--http-workers N``).
        self.batches: BatchRunner | None = None

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
                    self.lora = LoraRoutes(self.manager, self.lora_placement)
                    if self.batches is not None:
                        self.batches.start()  # resumes the batches its directory holds
                except Exception as exc:
                    log.exception("frontend failed to start")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.offload.close()
                if self.batches is not None:
                    await self.batches.stop()
                await self._on_shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- routing ---------------------------------------------------------------------------

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        method, path = scope["method"], scope["path"]
        try:  # a path or method not in the route table (_routes.py): 404 or 405
            if await refuse(route_of(path), method, path, send):
                return
            if path == "/v1/chat/completions" and method == "POST":
                await self._generate(scope, receive, send, "chat")
            elif path == "/v1/completions" and method == "POST":
                await self._generate(scope, receive, send, "completions")
            elif path == "/v1/embeddings" and method == "POST":
                await self._embeddings(scope, receive, send)
            elif path == "/v1/responses" and method == "POST":
                await create_response(self, scope, receive, send)
            elif path.startswith(PREFIX):
                await stored_response(self.responses, method, path, send)
            elif path.startswith(BATCH_PREFIXES):
                await serve_batch_api(self, scope, receive, send)
            elif path in MESSAGES_ROUTES:  # Anthropic's Messages API (_messages.py)
                await serve_messages(self, scope, receive, send)
            elif path == "/v1/models" and method == "GET":
                assert self.manager is not None
                await reply(send, 200, models_body(self.manager))
            elif path in ("/health", "/live") and method == "GET":
                await reply(send, *health(self.manager, path))
            elif path == "/metrics" and method == "GET":
                page = self.metrics.render() if self.metrics_page is None else (
                    await self.metrics_page())
                await reply(send, 200, page, _METRICS_TYPE)
            elif path == "/clear_kv_blocks" and method == "POST":
                assert self.manager is not None
                await serve_clear_kv_blocks(self.manager, self.limits, scope, receive, send)
            elif path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter") and (
                    method == "POST"):
                assert self.lora is not None
                await serve_lora_adapter(self.lora, self.limits, scope, receive, send,
                                         path.endswith("/load_lora_adapter"))
            else:  # listed in the route table, not dispatched above
                await error(send, http_errors.not_found(f"no route {path}"))
        except ClientGone:
            pass

    # -- generation ------------------------------------------------------------------------

    async def _generate(self, scope: Scope, receive: Receive, send: Send, endpoint: str) -> None:
        assert self.manager is not None
        ticket: Ticket | None = None
        try:
            body = await read_body(receive, scope, self.limits)
            ticket = self.admit(scope)
            target = self.target(scope)
            timeout = request_timeout(scope, self.timeout)
            priority = header_priority(scope)
            session = session_id(scope)
            req: ChatCompletionRequest | CompletionRequest
            work: list[SubRequest]
            if endpoint == "chat":
                req = parse_chat(body)
                if priority is not None:  # the header wins over the body (_priority.py)
                    req.priority = priority
                entry, only = self.entry(req.model)
                prompt_chars(entry.preprocessor, req)
                images = await load_images(entry, req, self.media)
                work, n = await self.offload.run(len(body), chat_work, entry, req, images)
            else:
                req = parse_completion(body)
                if priority is not None:
                    req.priority = priority
                entry, only = self.entry(req.model)
                prompt_chars(entry.preprocessor, req)
                work, n = await self.offload.run(len(body), completion_work, entry, req)
            if only is not None:  # a LoRA adapter's request
                for sub in work:
                    sub.pre.lora_name = req.model
            if req.logit_bias:
                entry.require(Capability.LOGIT_BIAS, "logit_bias")
            first = work[0].pre
            # (best_of asks its sub-requests for logprobs it does not return: required above)
            logprobs = first.output.logprobs if asks_logprobs(req) else None
            if logprobs is not None:
                entry.require(Capability.LOGPROBS, "logprobs")
            if Capability.EMBEDDINGS_ONLY in entry.capabilities:
                raise http_errors.embeddings_only(entry.name, entry.engine_name)
            if not entry.router.instance_ids():
                raise http_errors.no_worker(f"no live worker serves model {req.model!r}")
            prompt_tokens = sum(len(s.pre.token_ids) for s in work if s.number == 0)
            if ticket is not None:
                ticket.reserve(prompt_tokens, sum(s.pre.stop.max_tokens or 0 for s in work))
        except HttpError as exc:
            self.refuse_request(endpoint, exc, ticket)
            await error(send, exc)
            return
        served = entry.name if only is None else req.model  # vLLM answers with the adapter's
        fmt = ChatFormatter(served) if endpoint == "chat" else CompletionFormatter(served)
        include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
        if include_usage and req.stream_options and req.stream_options.continuous_usage_stats:
            fmt.continuous_usage = True
        fmt.logprobs = logprobs
        streaming = bool(req.stream)
        # The deadline also travels as the runtime's per-request timeout (the worker enforces
        # it too).
        options = RouteOptions(instance_id=target, idle_timeout=self.idle_timeout, timeout=timeout,
                               session_id=session, only=only)
        request_scope = RequestScope(self.metrics, entry.name, endpoint, streaming, fmt.id,
                                     receive, options, prompt_tokens, self.in_flight)
        try:
            async with request_scope:
                request_scope.status = await self._run(
                    request_scope, send, entry, work, fmt, include_usage, n
                )
        finally:
            request_scope.settle(ticket)

    async def _embeddings(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/embeddings``: every input routed as its own request (``_embeddings.py``),
        with the request's deadline, disconnect watch and metrics as for a generation."""
        m, endpoint = self.metrics, "embeddings"
        ticket: Ticket | None = None
        try:
            body = await read_body(receive, scope, self.limits)
            ticket = self.admit(scope)
            target = self.target(scope)
            timeout = request_timeout(scope, self.timeout)
            req, inputs = parse_embedding(body)
            entry, only = self.entry(req.model)
            request_id = f"embd-{uuid.uuid4().hex}"
            text_chars(entry.preprocessor, [
                ("input" if len(inputs) == 1 else f"input[{i}]", t)
                for i, t in enumerate(inputs) if isinstance(t, str)
            ])
            requests = await self.offload.run(
                len(body), embedding_requests, entry, req, inputs, request_id
            )
            for r in requests if only is not None else ():
                r.lora_name = req.model
            if not entry.router.instance_ids():
                raise http_errors.no_worker(f"no live worker serves model {req.model!r}")
            prompt_tokens = sum(len(r.token_ids) for r in requests)
            if ticket is not None:
                ticket.reserve(prompt_tokens, 0)
        except HttpError as exc:
            self.refuse_request(endpoint, exc, ticket)
            await error(send, exc)
            return
        options = RouteOptions(instance_id=target, idle_timeout=self.idle_timeout, timeout=timeout,
                               only=only)
        request_scope = RequestScope(m, entry.name, endpoint, False, request_id, receive, options,
                                     prompt_tokens, self.in_flight)
        try:
            async with request_scope:
                request_scope.status = await serve_embeddings(request_scope, entry, req,
                                                              requests, send)
        finally:
            request_scope.settle(ticket)

    def admit(self, scope: Scope) -> Ticket | None:
        """The request's tenant ticket (None: no tenant limits); 429 over its request rate."""
        return None if self.tenants is None else self.tenants.admit(scope)

    def refuse_request(self, endpoint: str, exc: HttpError, ticket: Ticket | None) -> None:
        """Count a request refused before it reached a worker."""
        self.metrics.requests.labels("", endpoint, "unknown", "error").inc()
        self._rejections.note(endpoint, exc)
        if ticket is not None:
            ticket.refused(exc)

    def entry(self, model: str) -> tuple[ModelEntry, frozenset[int] | None]:
        """The model's entry, and the only instances its request may go to (a LoRA adapter's
        holders; None: any)."""
        assert self.manager is not None
        return resolve_model(self.manager, model)

    def target(self, scope: Scope) -> int | None:
        """The instance a ``direct``-mode request names (``_direct.py``)."""
        assert self.manager is not None
        return direct_target(scope, self.manager.mode)

    def migration(
        self, entry: ModelEntry, pre: PreprocessedRequest, options: RouteOptions
    ) -> Migration | None:
        """The request's migration to another worker if the one serving it is lost mid-stream
        (None: off, or direct mode, which names its worker)."""
        limit = entry.migration_limit
        if limit is None:
            limit = self.migration_limit
        if limit <= 0 or options.instance_id is not None:
            return None
        counter, model = self.metrics.migrations, entry.name
        deadline = None
        if options.timeout is not None:
            deadline = asyncio.get_running_loop().time() + options.timeout
        return Migration(
            entry.router, pre, limit, self.idle_timeout, deadline,
            on_migrate=lambda kind: counter.labels(model, kind).inc(),
            stall_timeout=self.stall_timeout, options=options,
        )

    async def _run(
        self,
        scope: RequestScope,
        send: Send,
        entry: ModelEntry,
        subs: list[SubRequest],
        fmt: ChatFormatter | CompletionFormatter,
        include_usage: bool,
        n: int,
    ) -> str:
        """Send a generation request's sub-requests (one, or one per sequence: ``FanOut``) under
        ``scope`` and answer it; how it ended (the status label)."""
        fan = FanOut(
            self.metrics, entry.name, fmt, subs, n, scope.prompt_tokens, scope.started,
            scope.ending, lambda pre: self.migration(entry, pre, scope.options),
        )
        try:
            failure = await fan.open(entry.router, scope.ctx, scope.options)
            if failure is not None:
                await error(send, failure)
                return "error"
            headers = [(SERVED_BY_HEADER, fan.served_by())]
            if scope.streaming:
                return await fan.stream_sse(send, headers, include_usage)
            return await fan.respond_once(send, headers)
        finally:
            scope.completion_tokens, scope.ttft = fan.completion_tokens, fan.ttft
            await fan.close()
