"""LoRA adapters through a frontend, for tests: vLLM's load and unload routes, and completions
whose ``model`` is an adapter, answered with where they ran and what the worker had cached."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import openai

from tests.support.http_calls import post

__all__ = ["Completion", "complete", "load_adapter", "unload_adapter"]


async def load_adapter(url: str, name: str, path: Path | str, **extra: object
                       ) -> tuple[int, bytes]:
    """``POST /v1/load_lora_adapter``: the status and the body."""
    body = json.dumps({"lora_name": name, "lora_path": str(path), **extra}).encode()
    return await asyncio.to_thread(post, f"{url}/v1/load_lora_adapter", body)


async def unload_adapter(url: str, name: str, **extra: object) -> tuple[int, bytes]:
    """``POST /v1/unload_lora_adapter``: the status and the body."""
    body = json.dumps({"lora_name": name, **extra}).encode()
    return await asyncio.to_thread(post, f"{url}/v1/unload_lora_adapter", body)


@dataclass(frozen=True)
class Completion:
    """One completion: the worker (hex) that served it, the prompt tokens its worker had
    cached, and the ``model`` the response names."""

    worker: str
    cached: int
    model: str


async def complete(client: openai.AsyncOpenAI, model: str, prompt: list[int] | str,
                   max_tokens: int = 2) -> Completion:
    """A completion of ``prompt`` with ``model`` (a base model or an adapter)."""
    raw = await client.completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=max_tokens
    )
    body = raw.parse()
    details = body.usage.prompt_tokens_details if body.usage else None
    cached = (details.cached_tokens if details else 0) or 0
    return Completion(raw.headers["x-dynamo-worker"].split("/")[0], cached, body.model)
