"""Embeddings from vLLM's pooling runner (``--runner pooling --convert embed``): what the
engine can do in that mode, and one request's embedding through ``AsyncLLM.encode``."""

from __future__ import annotations

import contextlib
from typing import Any

from dynamo_zmq import errors
from dynamo_zmq.context import Context
from dynamo_zmq.llm import Capability, PreprocessedRequest

__all__ = ["embed", "pooling_capabilities"]


async def pooling_capabilities(llm: Any) -> frozenset[str]:
    """The capabilities of a pooling-runner ``AsyncLLM``: embeddings only (it cannot generate)
    when it supports vLLM's ``embed`` task, ``dimensions`` for a matryoshka model."""
    caps = {Capability.EMBEDDINGS_ONLY}
    if "embed" in await llm.get_supported_tasks():
        caps.add(Capability.EMBEDDINGS)
        if llm.vllm_config.model_config.is_matryoshka:
            caps.add(Capability.EMBEDDING_DIMENSIONS)
    return frozenset(caps)


async def embed(llm: Any, request: PreprocessedRequest, ctx: Context, rid: str) -> list[float]:
    """The embedding of ``request.token_ids`` (vLLM's pooler: last token, normalised).

    Raises:
        InvalidArgument: vLLM refused the request (``dimensions``, prompt too long).
        Cancelled: ``ctx`` was stopped (the caller aborts the request in vLLM).
        EngineShutdown: vLLM's engine core died.
    """
    from vllm import PoolingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.exceptions import EngineDeadError

    dimensions = request.embedding.dimensions if request.embedding is not None else None
    params = PoolingParams(task="embed", dimensions=dimensions)
    stream = llm.encode(TokensPrompt(prompt_token_ids=list(request.token_ids)), params, rid)
    final = None
    try:
        async for out in stream:
            final = out
            if ctx.is_stopped():
                break
    except (VLLMValidationError, ValueError, TypeError) as exc:
        raise errors.InvalidArgument(f"vLLM rejected the request: {exc}") from exc
    except EngineDeadError as exc:
        raise errors.EngineShutdown(f"vLLM's engine core died: {exc}") from exc
    finally:
        with contextlib.suppress(Exception):
            await stream.aclose()  # early: aborts the request inside vLLM
    if ctx.is_stopped():
        raise errors.Cancelled("the embedding request was stopped")
    data = getattr(getattr(final, "outputs", None), "data", None)
    if final is None or not final.finished or data is None:
        raise errors.Unknown("vLLM's pooling stream ended without an embedding")
    vector: list[float] = data.float().tolist()
    return vector
