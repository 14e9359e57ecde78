"""The OpenAI Responses API: ``POST /v1/responses`` (streaming and not), and
``GET`` / ``DELETE /v1/responses/{id}`` for stored responses.

A request is translated into the internal chat request (``_responses_request.py``: its input
after the conversation of ``previous_response_id``, from the store), preprocessed, admitted and
routed as a chat request is (tenant limits, deadline, priority, session, LoRA, migration:
``FanOut``), and the worker's outputs are written as Responses items and events
(``_responses_output.py``). A completed response is kept in this process's store
(``_responses_store.py``) unless the request says ``store: false``. Errors before the answer
begins are OpenAI's error object with its status; a stream that fails ends with
``response.failed``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..llm import Capability, FinishReason, RouteOptions
from . import errors as http_errors
from ._api_host import ApiHost
from ._api_params import ParamNames, responses_names
from ._asgi import JSON, SSE, Receive, Scope, Send, error, read_body, reply, send_message
from ._deadline import request_timeout
from ._fanout import FanOut
from ._images import load_images
from ._limits import prompt_chars
from ._priority import header_priority
from ._responses_output import ResponseBuilder
from ._responses_request import input_messages, parse_responses, to_chat
from ._responses_store import ResponsesStore
from ._scope import RequestScope
from ._sessions import session_id
from ._sse_chunks import Failed
from ._subrequests import chat_work
from ._tenants import Ticket
from .errors import HttpError
from .models import ModelEntry
from .responses import ChatFormatter

__all__ = ["PREFIX", "create_response", "stored_response"]

#: The path of ``/v1/responses/{id}``, before the id.
PREFIX = "/v1/responses/"
_ENDPOINT = "responses"
_SERVED_BY = b"x-dynamo-worker"  # app.SERVED_BY_HEADER


async def stored_response(store: ResponsesStore, method: str, path: str, send: Send) -> None:
    """``GET`` (the stored Response) or ``DELETE`` (``{"id", "object", "deleted"}``)
    ``/v1/responses/{id}``; 404 for an unknown id, 405 for another method."""
    response_id = path[len(PREFIX):]
    try:
        if method == "GET":
            await reply(send, 200, msgspec.json.encode(store.get(response_id)))
        elif method == "DELETE":
            store.delete(response_id)
            await reply(send, 200, msgspec.json.encode(
                {"id": response_id, "object": "response", "deleted": True}))
        else:
            raise HttpError(405, "invalid_request_error", f"{method} is not allowed on {path}")
    except HttpError as exc:
        await error(send, exc)


async def create_response(app: ApiHost, scope: Scope, receive: Receive, send: Send) -> None:
    """``POST /v1/responses``."""
    assert app.manager is not None
    store = app.responses
    ticket: Ticket | None = None
    names: ParamNames | None = None  # the Responses names of chat's parameters
    try:
        body = await read_body(receive, scope, app.limits)
        ticket = app.admit(scope)
        target = app.target(scope)
        timeout = request_timeout(scope, app.timeout)
        priority = header_priority(scope)
        session = session_id(scope)
        rreq = parse_responses(body)
        conversation: list[dict[str, Any]] = []
        if rreq.previous_response_id is not None:
            conversation = store.conversation(rreq.previous_response_id)
        names = responses_names(rreq.input, bool(rreq.instructions), len(conversation))
        conversation += input_messages(rreq.input)
        req = to_chat(rreq, conversation)
        if priority is not None:  # the header wins over the body (_priority.py)
            req.priority = priority
        entry, only = app.entry(req.model)
        prompt_chars(entry.preprocessor, req)
        images = await load_images(entry, req, app.media)
        work, _ = await app.offload.run(len(body), chat_work, entry, req, images)
        if only is not None:  # a LoRA adapter's request
            work[0].pre.lora_name = req.model
        if Capability.EMBEDDINGS_ONLY in entry.capabilities:
            raise http_errors.embeddings_only(entry.name, entry.engine_name)
        if not entry.router.instance_ids():
            raise http_errors.no_worker(f"no live worker serves model {req.model!r}")
        prompt_tokens = len(work[0].pre.token_ids)
        if ticket is not None:
            ticket.reserve(prompt_tokens, work[0].pre.stop.max_tokens or 0)
    except HttpError as exc:
        if names is not None:
            exc = names.rename(exc)
        app.refuse_request(_ENDPOINT, exc, ticket)
        await error(send, exc)
        return
    served = entry.name if only is None else req.model
    streaming = bool(rreq.stream)
    builder = ResponseBuilder(rreq, served, streaming)
    builder.stored = rreq.store is not False and store.enabled
    options = RouteOptions(instance_id=target, idle_timeout=app.idle_timeout, timeout=timeout,
                           session_id=session, only=only)
    request_scope = RequestScope(app.metrics, entry.name, _ENDPOINT, streaming, builder.id,
                                 receive, options, prompt_tokens, app.in_flight)
    try:
        async with request_scope:
            fan = FanOut(app.metrics, entry.name, ChatFormatter(served), work, 1, prompt_tokens,
                         request_scope.started, request_scope.ending,
                         lambda pre: app.migration(entry, pre, options))
            try:
                request_scope.status = await _answer(request_scope, send, entry, fan, builder,
                                                     store, conversation)
            finally:
                request_scope.completion_tokens, request_scope.ttft = (fan.completion_tokens,
                                                                       fan.ttft)
                await fan.close()
    finally:
        request_scope.settle(ticket)


async def _answer(scope: RequestScope, send: Send, entry: ModelEntry, fan: FanOut,
                  builder: ResponseBuilder, store: ResponsesStore,
                  conversation: list[dict[str, Any]]) -> str:
    """Send the request and answer it (streamed events, or the Response object), storing a
    completed response (with ``conversation`` and its output) before its last bytes go, so a
    client may continue it at once; how it ended (the status label)."""
    failure = await fan.open(entry.router, scope.ctx, scope.options)
    if failure is not None:
        await error(send, failure)
        return "error"
    headers = [(_SERVED_BY, fan.served_by())]
    if scope.streaming:
        await send_message(send, {"type": "http.response.start", "status": 200,
                                  "headers": SSE + headers})
        builder.start()
    try:
        finish: str | None = None
        async for batch in fan.batches():
            for out in batch:
                if out.finish_reason == FinishReason.ERROR:
                    raise Failed(http_errors.engine_error(out.error or "engine error"))
                builder.add(out)
                finish = out.finish_reason or finish
            if scope.streaming and finish is None and (events := builder.take()):
                await _more(send, events)
    except Failed as failed:
        if not scope.streaming:
            await error(send, failed.error)
            return "error"
        builder.fail(failed.error)
        await _last(send, builder.take())
        return "error"
    builder.finish(finish, *fan.usage())
    if builder.stored:
        store.put(builder.body(), [*conversation, builder.assistant_message()])
    if scope.streaming:
        await _last(send, builder.take())
    else:
        await reply(send, 200, msgspec.json.encode(builder.body()), JSON + headers)
    return "success"


async def _more(send: Send, data: bytes) -> None:
    await send_message(send, {"type": "http.response.body", "body": data, "more_body": True})


async def _last(send: Send, data: bytes) -> None:
    await send_message(send, {"type": "http.response.body", "body": data, "more_body": False})
