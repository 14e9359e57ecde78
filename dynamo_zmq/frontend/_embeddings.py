"""``POST /v1/embeddings``: each input is tokenized here (the model's ``Preprocessor``) and
sent as its own request, ``PreprocessedRequest.embedding`` set, through the model's router to a
worker's generate endpoint, which answers one terminal output carrying the vector. The inputs
of a batch go concurrently (so a router may spread them over workers), each with a child of
the request's context: a disconnect or the deadline kills them all. Usage is summed."""

from __future__ import annotations

import asyncio
import base64
import struct

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
    RouteOptions,
    StopConditions,
)
from ..resources import cancel_and_wait
from ._asgi import Send, reply
from ._embed_protocol import EmbeddingRequest
from ._scope import RequestScope
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
    router: ModelRouter, request: PreprocessedRequest, ctx: Context, options: RouteOptions
) -> LLMEngineOutput:
    stream = await router.generate(request, ctx, options)
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
    options: RouteOptions,
) -> list[LLMEngineOutput]:
    """The terminal output (with its embedding) of each request, in order, each sent with
    ``options`` (instance, timeouts).

    Raises:
        DynamoError: a request failed (the others are killed): ``Cancelled`` when ``ctx`` was
            killed, what the router or the worker raised otherwise.
    """
    if len(requests) == 1:
        return [await _embed_one(router, requests[0], ctx, options)]
    children = []
    for i in range(len(requests)):
        child = Context(f"{ctx.id()}-{i}")
        ctx.link_child(child)
        children.append(child)
    tasks = [
        asyncio.ensure_future(_embed_one(router, r, c, options))
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
    scope: RequestScope,
    entry: ModelEntry,
    req: EmbeddingRequest,
    requests: list[PreprocessedRequest],
    send: Send,
) -> str:
    """Send a parsed embeddings request's ``requests`` under ``scope`` and answer; how it
    ended (the status label)."""
    try:
        outputs = await embed_all(entry.router, requests, scope.ctx, scope.options)
    except errors.DynamoError as exc:
        await scope.fail(send, exc)
        return "error"
    await reply(send, 200, embeddings_body(entry.name, outputs, req.encoding_format))
    return "success"
