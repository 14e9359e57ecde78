"""The frontend's answers about itself: ``GET /v1/models``, ``/health`` and ``/live``."""

from __future__ import annotations

import msgspec

from .models import ModelManager

__all__ = ["health", "models_body"]


def models_body(manager: ModelManager) -> bytes:
    """``GET /v1/models``: the models a live worker serves, in OpenAI's list shape, then the
    LoRA adapters a live worker holds, in vLLM's (``root``: the adapter's path on the
    workers, ``parent``: its base model)."""
    live = manager.live()
    data: list[dict[str, object]] = [
        {"id": m.name, "object": "model", "created": m.created, "owned_by": "dynamo-zmq"}
        for m in live
    ]
    bases = {m.name for m in live}
    data += [
        {"id": a.name, "object": "model", "created": a.created, "owned_by": "dynamo-zmq",
         "root": a.path, "parent": a.base}
        for a in manager.adapters.live() if a.base in bases
    ]
    return msgspec.json.encode({"object": "list", "data": data})


def health(manager: ModelManager | None, path: str) -> tuple[int, bytes]:
    """``/live`` (always 200 while the server answers) or ``/health`` (503 with no live worker,
    else each model's instances): the status and the body."""
    if path == "/live":
        return 200, b'{"status":"live"}'
    live = manager.live() if manager is not None else []
    body = {
        "status": "healthy" if live else "no_workers",
        "models": {m.name: [f"{i:x}" for i in m.router.instance_ids()] for m in live},
    }
    return (200 if live else 503), msgspec.json.encode(body)
