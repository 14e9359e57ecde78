"""``POST /v1/embeddings``: each input is tokenized here (the model's ``Preprocessor``) and
sent as its own request, ``PreprocessedRequest.embedding`` set, through the model's router to a
worker's generate endpoint, which answers one terminal output carrying the vector. The inputs
of a batch go concurrently (so a router may spread them over workers), each with a child of
the request's context: a disconnect or the deadline kills them all. Usage is summed."""

from __future__ import annotations

import asyncio
import base64
import struct
import time
from typing import Any

import msgspec

from .. import errors
from ..context import Context
from ..llm import (
    Capability,
    EmbeddingOptions,
    FinishReason,
    LLMEngineOutput,
    ModelRouter,
    PreprocessedRequest,
    StopConditions,
)
from ..resources import cancel_and_wait
from . import errors as http_errors
from ._asgi import ClientGone, Receive, Send, error, reply, watch_disconnect
from ._deadline import Deadline
from ._embed_protocol import EmbeddingRequest
from .metrics import FrontendMetrics
from .models import ModelEntry

__all__ = ["embed_all", "embedding_requests", "embeddings_body", "serve_embeddings"]


def embedding_requests(
    entry: ModelEntry, req: EmbeddingRequest, inputs: list[str | list[int]], request_id: str
) -> list[PreprocessedRequest]:
    """One preprocessed request per input.

    Raises:
        HttpError: 400 when the engine cannot embed (naming it) or cannot honour
            ``dimensions``, or for an input that does not tokenize; 413 for one too long.
    """
    entry.require(Capability.EMBEDDINGS, "input")
    if req.dimensions is not None:
        entry.require(Capability.EMBEDDING_DIMENSIONS, "dimensions")
    options = EmbeddingOptions(dimensions=req.dimensions)
    no_output = StopConditions(max_tokens=0)  # a KV router predicts no output blocks
    special = req.add_special_tokens is not False
    pre = entry.preprocessor
    return [
        PreprocessedRequest(
            token_ids=pre.embedding_tokens(item, special), model=entry.name,
            request_id=f"{request_id}-{i}", stop=no_output, embedding=options,
            mdcsum=pre.card.checksum,
        )
        for i, item in enumerate(inputs)
    ]


async def _embed_one(
    router: ModelRouter, request: PreprocessedRequest, ctx: Context, routing: dict[str, Any]
) -> LLMEngineOutput:
    stream = await router.generate(request, ctx, **routing)
    try:
        async for out in stream:
            if out.is_terminal:
                break
        else:
            raise errors.StreamIncomplete("the worker ended the stream without an embedding")
    finally:
        await stream.aclose()
    if out.finish_reason == FinishReason.CANCELLED:
        raise errors.Cancelled("the embedding request was cancelled")
    if out.finish_reason != FinishReason.STOP or out.embedding is None:
        raise errors.Unknown(out.error or f"the worker answered no embedding "
                                          f"(finish reason {out.finish_reason!r})")
    return out


async def embed_all(
    router: ModelRouter,
    requests: list[PreprocessedRequest],
    ctx: Context,
    routing: dict[str, Any],
) -> list[LLMEngineOutput]:
    """The terminal output (with its embedding) of each request, in order. ``routing`` holds
    the keyword arguments of ``ModelRouter.generate`` (instance, timeouts).

    Raises:
        DynamoError: a request failed (the others are killed): ``Cancelled`` when ``ctx`` was
            killed, what the router or the worker raised otherwise.
    """
    if len(requests) == 1:
        return [await _embed_one(router, requests[0], ctx, routing)]
    children = []
    for i in range(len(requests)):
        child = Context(f"{ctx.id()}-{i}")
        ctx.link_child(child)
        children.append(child)
    tasks = [
        asyncio.ensure_future(_embed_one(router, r, c, routing))
        for r, c in zip(requests, children, strict=True)
    ]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        if not all(t.done() for t in tasks):
            for child in children:  # one failed: the others' workers stop too
                child.kill()
            await cancel_and_wait(tasks)


def _base64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def embeddings_body(model: str, outputs: list[LLMEngineOutput], encoding: str) -> bytes:
    """OpenAI's response: ``{"object": "list", "data": [...], "model", "usage"}``."""
    data = []
    tokens = 0
    for i, out in enumerate(outputs):
        vector = out.embedding or []
        value: list[float] | str = _base64(vector) if encoding == "base64" else vector
        data.append({"object": "embedding", "index": i, "embedding": value})
        tokens += out.usage.prompt_tokens if out.usage is not None else 0
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return msgspec.json.encode({"object": "list", "data": data, "model": model, "usage": usage})


async def serve_embeddings(
    m: FrontendMetrics,
    entry: ModelEntry,
    req: EmbeddingRequest,
    requests: list[PreprocessedRequest],
    ctx: Context,
    receive: Receive,
    send: Send,
    routing: dict[str, Any],
    timeout: float | None,
) -> None:
    """Send a parsed embeddings request's ``requests`` (``routing``: the router's keyword
    arguments) and answer, with the request's deadline, disconnect watch and metrics as for a
    generation."""
    endpoint = "embeddings"
    model = entry.name
    m.inflight.labels(model).inc()
    m.isl.labels(model).observe(sum(len(r.token_ids) for r in requests))
    watcher = asyncio.create_task(watch_disconnect(receive, ctx), name=f"disconnect-{ctx.id()}")
    started = time.monotonic()
    deadline = None if timeout is None else Deadline(ctx, timeout)
    status = "error"
    try:
        outputs = await embed_all(entry.router, requests, ctx, routing)
        await reply(send, 200, embeddings_body(model, outputs, req.encoding_format))
        status = "success"
    except errors.DynamoError as exc:
        if deadline is not None and deadline.expired:
            await error(send, deadline.error())
        elif ctx.is_killed():
            status = "disconnected"
        else:
            await error(send, http_errors.from_dynamo(exc))
    except ClientGone:
        ctx.kill()
        status = "disconnected"
    finally:
        if deadline is not None:
            deadline.cancel()
        await cancel_and_wait((watcher,))
        if status == "disconnected":
            m.disconnected.labels(model).inc()
        m.requests.labels(model, endpoint, "unary", status).inc()
        m.inflight.labels(model).dec()
        m.duration.labels(model).observe(time.monotonic() - started)
