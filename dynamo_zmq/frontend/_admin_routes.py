"""The frontend's admin routes beside the APIs: Dynamo's ``POST /clear_kv_blocks``
(``_clear_kv.py``) and vLLM's ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
(``_lora.py``): read the body, do the work, answer (errors in OpenAI's shape)."""

from __future__ import annotations

import msgspec

from ._asgi import Receive, Scope, Send, error, read_body, reply
from ._clear_kv import clear_kv_blocks, parse_clear_request
from ._limits import HttpLimits
from ._lora import LoraRoutes
from .errors import HttpError
from .models import ModelManager

__all__ = ["serve_clear_kv_blocks", "serve_lora_adapter"]

_TEXT = [(b"content-type", b"text/plain; charset=utf-8")]


async def serve_clear_kv_blocks(
    manager: ModelManager, limits: HttpLimits, scope: Scope, receive: Receive, send: Send
) -> None:
    """``POST /clear_kv_blocks``: every worker of the model (or of all models) drops its cache."""
    try:
        model = parse_clear_request(await read_body(receive, scope, limits))
        body = await clear_kv_blocks(manager, model)
    except HttpError as exc:
        await error(send, exc)
        return
    await reply(send, 200, msgspec.json.encode(body))


async def serve_lora_adapter(
    lora: LoraRoutes, limits: HttpLimits, scope: Scope, receive: Receive, send: Send, load: bool
) -> None:
    """``POST /v1/load_lora_adapter`` (``load``) or ``/v1/unload_lora_adapter``: vLLM's text."""
    try:
        body = await read_body(receive, scope, limits)
        text = await (lora.load(body) if load else lora.unload(body))
    except HttpError as exc:
        await error(send, exc)
        return
    await reply(send, 200, text, _TEXT)
