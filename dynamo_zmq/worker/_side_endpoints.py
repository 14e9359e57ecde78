"""The worker's endpoints beside ``generate``: ``model_files`` (the files its model card lists,
for a frontend that has no copy of the model), ``clear_kv_blocks`` (the engine drops its
prefix cache), and ``load_lora`` / ``unload_lora`` (the engine loads or unloads a LoRA adapter;
after each success the worker re-advertises its model with the engine's adapters)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from .. import errors
from ..llm import CHUNK, LLMEngine, ModelCard, read_card_file

__all__ = ["SideEndpoints"]

log = logging.getLogger("dynamo_zmq.worker")


class SideEndpoints:
    """The handlers of ``model_files``, ``clear_kv_blocks``, ``load_lora`` and ``unload_lora``
    for one engine and its card.

    Args:
        engine: the worker's engine (started).
        model_dir: the model's directory (``--model-path``).
        card: the model card the worker advertises.
        on_adapters: called after each successful load or unload (the worker re-advertises).
    """

    def __init__(self, engine: LLMEngine, model_dir: str, card: ModelCard,
                 on_adapters: Callable[[], None] = lambda: None) -> None:
        self._engine = engine
        self._model_dir = model_dir
        self._card = card
        self._on_adapters = on_adapters
        self._lora_lock = asyncio.Lock()  # one load or unload at a time

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

    async def load_lora(self, request: Any) -> AsyncIterator[dict[str, Any]]:
        """``{"lora_name": N, "lora_path": P}``: the engine loads adapter ``P`` as ``N``.

        Raises:
            InvalidArgument: a malformed request, a bad path or rank, ``N`` already loaded.
            Unsupported: the engine has no adapters.
        """
        name = _field(request, "lora_name", "load_lora")
        path = _field(request, "lora_path", "load_lora")
        async with self._lora_lock:
            if name in self._engine.lora_adapters():
                raise errors.InvalidArgument(f"the LoRA adapter {name!r} is already loaded")
            await self._engine.load_lora(name, path)
            self._on_adapters()
        log.info("LoRA adapter %r loaded from %s", name, path)
        yield {"status": "success", "lora_name": name, "lora_path": path}

    async def unload_lora(self, request: Any) -> AsyncIterator[dict[str, Any]]:
        """``{"lora_name": N}``: the engine unloads adapter ``N``.

        Raises:
            NotFound: no adapter ``N`` is loaded.
            Unsupported: the engine has no adapters.
        """
        name = _field(request, "lora_name", "unload_lora")
        async with self._lora_lock:
            if name not in self._engine.lora_adapters():
                raise errors.NotFound(f"the LoRA adapter {name!r} is not loaded")
            await self._engine.unload_lora(name)
            self._on_adapters()
        log.info("LoRA adapter %r unloaded", name)
        yield {"status": "success", "lora_name": name}


def _field(request: Any, key: str, endpoint: str) -> str:
    value = request.get(key) if isinstance(request, dict) else None
    if not isinstance(value, str) or not value:
        raise errors.InvalidArgument(f"{endpoint} expects a non-empty string {key!r}")
    return value
