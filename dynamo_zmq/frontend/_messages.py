"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API.

A request is translated into the chat request it is (``_anthropic_protocol.to_chat``) and goes
the chat route's way: the same admission (tenant), preprocessing (chat template, tokenizer,
tools, reasoning parser), routing, migration, deadline and metrics (endpoint label
``messages``); its outputs are answered as Anthropic's events or body (``_anthropic_run.py``).
Every error is in Anthropic's shape (``_anthropic_errors.anthropic_send``).
``count_tokens`` renders and tokenizes the prompt exactly as a messages request would, and
answers ``{"input_tokens": N}`` without asking a worker (nor a tenant's budget).
"""

from __future__ import annotations

import uuid

import msgspec

from ..llm import Capability, RouteOptions
from . import errors as http_errors
from ._anthropic_errors import anthropic_send
from ._anthropic_protocol import MessagesRequest, parse_count_tokens, parse_messages, to_chat
from ._anthropic_run import MessagesRun
from ._api_host import ApiHost
from ._api_params import ParamNames, messages_names
from ._asgi import Receive, Scope, Send, error, read_body, reply
from ._deadline import request_timeout
from ._images import load_images
from ._limits import prompt_chars
from ._priority import header_priority
from ._scope import RequestScope
from ._sessions import session_id
from ._subrequests import SubRequest, chat_work
from ._tenants import Ticket
from .errors import HttpError
from .models import ModelEntry
from .responses import ChatFormatter

__all__ = ["serve_messages"]

#: The response header naming the instance that served the request (as app.py's).
_SERVED_BY = b"x-dynamo-worker"
_ENDPOINT = "messages"


async def serve_messages(app: ApiHost, scope: Scope, receive: Receive, send: Send) -> None:
    """Serve a request on one of the Messages API's routes (405 for a method but POST)."""
    send = anthropic_send(send)
    path = scope["path"]
    if scope["method"] != "POST":
        await error(send, HttpError(405, "invalid_request_error",
                                    f"{scope['method']} is not allowed on {path}"))
    elif path.endswith("/count_tokens"):
        await _count_tokens(app, scope, receive, send)
    else:
        await _messages(app, scope, receive, send)


async def _count_tokens(app: ApiHost, scope: Scope, receive: Receive, send: Send) -> None:
    names: ParamNames | None = None  # Anthropic's names of chat's parameters
    try:
        body = await read_body(receive, scope, app.limits)
        req = parse_count_tokens(body)
        chat = to_chat(req)
        names = messages_names(bool(req.system), req.messages)
        entry, _ = app.entry(req.model)
        prompt_chars(entry.preprocessor, chat)
        images = await load_images(entry, chat, app.media)
        pre = await app.offload.run(len(body), entry.preprocessor.chat, chat, entry.require,
                                     images, entry.vision)
    except HttpError as exc:
        if names is not None:
            exc = names.rename(exc)
        app.refuse_request("count_tokens", exc, None)
        await error(send, exc)
        return
    await reply(send, 200, msgspec.json.encode({"input_tokens": len(pre.token_ids)}))


async def _messages(app: ApiHost, scope: Scope, receive: Receive, send: Send) -> None:
    ticket: Ticket | None = None
    names: ParamNames | None = None
    try:
        body = await read_body(receive, scope, app.limits)
        ticket = app.admit(scope)
        target = app.target(scope)
        timeout = request_timeout(scope, app.timeout)
        req = parse_messages(body)
        chat = to_chat(req)
        names = messages_names(bool(req.system), req.messages)
        priority = header_priority(scope)
        if priority is not None:
            chat.priority = priority
        entry, only = app.entry(req.model)
        prompt_chars(entry.preprocessor, chat)
        images = await load_images(entry, chat, app.media)
        work, _ = await app.offload.run(len(body), chat_work, entry, chat, images)
        pre = work[0].pre
        if only is not None:  # a LoRA adapter's request
            pre.lora_name = req.model
        if req.thinking is not None and req.thinking.type == "disabled":
            pre.reasoning = False  # the reasoning stays in the text
        if Capability.EMBEDDINGS_ONLY in entry.capabilities:
            raise http_errors.embeddings_only(entry.name, entry.engine_name)
        if not entry.router.instance_ids():
            raise http_errors.no_worker(f"no live worker serves model {req.model!r}")
        prompt_tokens = len(pre.token_ids)
        if ticket is not None:
            ticket.reserve(prompt_tokens, pre.stop.max_tokens or 0)
    except HttpError as exc:
        if names is not None:
            exc = names.rename(exc)
        app.refuse_request(_ENDPOINT, exc, ticket)
        await error(send, exc)
        return
    served = entry.name if only is None else req.model
    options = RouteOptions(instance_id=target, idle_timeout=app.idle_timeout, timeout=timeout,
                           session_id=session_id(scope), only=only)
    message_id = f"msg_{uuid.uuid4().hex}"
    request_scope = RequestScope(app.metrics, entry.name, _ENDPOINT, req.stream, message_id,
                                 receive, options, prompt_tokens, app.in_flight)
    try:
        async with request_scope:
            request_scope.status = await _run(app, request_scope, send, entry, work, req,
                                              served, message_id)
    finally:
        request_scope.settle(ticket)


async def _run(app: ApiHost, scope: RequestScope, send: Send, entry: ModelEntry,
               work: list[SubRequest], req: MessagesRequest, served: str,
               message_id: str) -> str:
    """Send the request's one sequence under ``scope`` and answer it; the status label."""
    run = MessagesRun(
        app.metrics, entry.name, ChatFormatter(served), work, 1, scope.prompt_tokens,
        scope.started, scope.ending, lambda pre: app.migration(entry, pre, scope.options),
    )
    run.message_id, run.served, run.stops = message_id, served, tuple(req.stop_sequences or ())
    try:
        failure = await run.open(entry.router, scope.ctx, scope.options)
        if failure is not None:
            await error(send, failure)
            return "error"
        headers = [(_SERVED_BY, run.served_by())]
        if req.stream:
            return await run.stream_events(send, headers)
        return await run.respond_message(send, headers)
    finally:
        scope.completion_tokens, scope.ttft = run.completion_tokens, run.ttft
        await run.close()
