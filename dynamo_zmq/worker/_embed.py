"""The worker's side of an embedding request (``PreprocessedRequest.embedding`` set): the
engine's ``embed``, with the same admission, cancellation and metrics as a generation, answered
as one terminal output carrying the vector."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from .. import errors
from ..context import Context
from ..llm import FinishReason, LLMEngine, LLMEngineOutput, PreprocessedRequest, Usage
from ._health import Health
from ._metrics import ModelMetrics

__all__ = ["serve_embedding"]


async def serve_embedding(
    engine: LLMEngine,
    request: PreprocessedRequest,
    ctx: Context,
    metrics: ModelMetrics,
    health: Health,
    spawn_abort: Callable[[Context], object],
) -> AsyncIterator[LLMEngineOutput]:
    """Embed ``request.token_ids`` with ``engine``; one terminal output (``stop``, usage
    counting the prompt) with the embedding. A stopped or killed request aborts the engine's
    work (``spawn_abort``) and ends ``cancelled``."""
    metrics.requests.inc()
    metrics.inflight.inc()
    health.request_started()
    engine_ctx = Context(ctx.id())
    ctx.link_child(engine_ctx)
    aborted = False

    def abort(_killed: bool) -> None:
        nonlocal aborted
        if not aborted:
            aborted = True
            metrics.cancellations.inc()
            spawn_abort(engine_ctx)

    remove = ctx.add_listener(abort)
    start = time.monotonic()
    usage = Usage(prompt_tokens=len(request.token_ids))
    try:
        try:
            vector = await engine.embed(request, engine_ctx)
        except errors.Cancelled:
            if not ctx.is_stopped():
                raise
            vector = None
        if vector is None or ctx.is_stopped():
            yield LLMEngineOutput(finish_reason=FinishReason.CANCELLED, usage=usage)
            return
        yield LLMEngineOutput(finish_reason=FinishReason.STOP, usage=usage, embedding=vector)
    finally:
        remove()
        metrics.duration.observe(time.monotonic() - start)
        metrics.inflight.dec()
        health.request_ended()
