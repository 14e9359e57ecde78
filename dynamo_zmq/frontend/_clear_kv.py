"""``POST /clear_kv_blocks``: Dynamo's route that has every worker drop its prefix cache.

The frontend calls the ``clear_kv_blocks`` endpoint of every worker serving a model (the body's
``{"model": NAME}``, or every model when the body is empty), each worker directly and all at
once, and answers with Dynamo's shape::

    {"cleared_workers": [{"name", "endpoint", "status", "response", "model"}, ...],
     "failed_workers":  [{"name", "endpoint", "status", "error", "model"}, ...]}

(``name`` is ``<namespace>/<component>-instance-<instance id hex>``). A worker whose engine
cannot clear its cache (``Unsupported``), or that fails, is listed in ``failed_workers``; the
others are cleared all the same. The engines publish the matching KV events, so KV routers
forget the blocks too.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from .. import errors
from ..llm import ServedModel, served_models
from . import errors as http_errors
from .models import ModelManager

__all__ = ["CLEAR_KV_ENDPOINT", "clear_kv_blocks", "parse_clear_request"]

#: The workers' endpoint (Dynamo's name), in each worker's component.
CLEAR_KV_ENDPOINT = "clear_kv_blocks"
#: Seconds one worker may take to answer.
CLEAR_TIMEOUT = 30.0


class _ClearRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: str | None = None


def parse_clear_request(body: bytes) -> str | None:
    """The model named in the body (None: every model).

    Raises:
        HttpError: 400 when the body is not ``{"model": NAME}`` (or empty).
    """
    if not body.strip():
        return None
    try:
        return msgspec.json.decode(body, type=_ClearRequest).model
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        message = f'expected an empty body or {{"model": NAME}}: {exc}'
        raise http_errors.bad_request(message) from exc


async def clear_kv_blocks(manager: ModelManager, model: str | None) -> dict[str, Any]:
    """Call ``clear_kv_blocks`` on every worker serving ``model`` (None: every model).

    Raises:
        HttpError: 404 for a model never seen.
    """
    if model is not None and manager.get(model) is None:
        raise http_errors.model_not_found(model)
    peers = await manager.runtime.peers(manager.namespace)
    targets = [
        s for s in served_models(peers, manager.namespace)
        if model is None or s.advert.name == model
    ]
    results = await asyncio.gather(*(_clear_one(manager, s) for s in targets))
    body: dict[str, Any] = {
        "cleared_workers": [r for ok, r in results if ok],
        "failed_workers": [r for ok, r in results if not ok],
    }
    if not targets:
        body["message"] = "No active worker groups found"
    return body


async def _clear_one(manager: ModelManager, served: ServedModel) -> tuple[bool, dict[str, Any]]:
    ns, comp = served.endpoint.namespace, served.endpoint.component
    entry: dict[str, Any] = {
        "name": f"{ns}/{comp}-instance-{served.instance_id:x}",
        "endpoint": f"{ns}/{comp}/{CLEAR_KV_ENDPOINT}",
        "model": served.advert.name,
    }
    try:
        endpoint = manager.runtime.namespace(ns).component(comp).endpoint(CLEAR_KV_ENDPOINT)
        client = await endpoint.client()
        stream = await client.direct({}, served.instance_id, timeout=CLEAR_TIMEOUT)
        answers = [r.data() async for r in stream]
    except errors.DynamoError as exc:
        entry["status"] = "Failed to clear kv blocks for instance"
        entry["error"] = f"{exc.kind}: {exc.message}"
        return False, entry
    entry["status"] = "Successfully cleared kv blocks for instance"
    entry["response"] = answers[0] if answers else None
    return True, entry
