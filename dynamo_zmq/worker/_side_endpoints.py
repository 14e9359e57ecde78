"""The worker's endpoints beside ``generate``: ``model_files`` (the files its model card lists,
for a frontend that has no copy of the model) and ``clear_kv_blocks`` (the engine drops its
prefix cache)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from .. import errors
from ..llm import CHUNK, LLMEngine, ModelCard, read_card_file

__all__ = ["SideEndpoints"]

log = logging.getLogger("dynamo_zmq.worker")


class SideEndpoints:
    """The handlers of ``model_files`` and ``clear_kv_blocks`` for one engine and its card.

    Args:
        engine: the worker's engine (started).
        model_dir: the model's directory (``--model-path``).
        card: the model card the worker advertises.
    """

    def __init__(self, engine: LLMEngine, model_dir: str, card: ModelCard) -> None:
        self._engine = engine
        self._model_dir = model_dir
        self._card = card

    async def model_files(self, request: dict[str, Any]) -> AsyncIterator[bytes]:
        """Stream one file the model card lists: ``{"name": "tokenizer.json"}``."""
        name = request.get("name") if isinstance(request, dict) else None
        if not isinstance(name, str):
            raise errors.InvalidArgument('model_files expects {"name": FILE}')
        try:
            data = await asyncio.to_thread(read_card_file, self._model_dir, self._card, name)
        except ValueError as exc:
            raise errors.InvalidArgument(str(exc)) from exc
        for offset in range(0, len(data), CHUNK):
            yield data[offset : offset + CHUNK]

    async def clear_kv_blocks(self, request: Any) -> AsyncIterator[dict[str, Any]]:
        """Dynamo's ``clear_kv_blocks`` endpoint: the engine drops its prefix cache (and tells
        routers, through its KV events). An engine without the hook answers ``Unsupported``."""
        await self._engine.clear_kv_blocks()
        log.info("KV blocks cleared on request")
        yield {"status": "success", "message": "KV cache cleared"}
