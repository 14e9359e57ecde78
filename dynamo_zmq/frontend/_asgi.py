"""ASGI plumbing the frontend's routes share: reading a body, replying, errors in OpenAI's
shape, and noticing that the client went away."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from ..context import Context
from .errors import HttpError

__all__ = [
    "JSON",
    "MAX_BODY",
    "SSE",
    "ClientGone",
    "Receive",
    "Scope",
    "Send",
    "error",
    "header",
    "read_body",
    "reply",
    "send_message",
    "watch_disconnect",
]

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

#: Largest request body read, in bytes (413 beyond).
MAX_BODY = 32 * 1024 * 1024
JSON = [(b"content-type", b"application/json")]
SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class ClientGone(Exception):
    """The HTTP client disconnected; nothing more can be sent."""


def header(scope: Scope, name: bytes) -> bytes | None:
    """The value of request header ``name`` (lower case), or None."""
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value)
    return None


async def watch_disconnect(receive: Receive, ctx: Context) -> None:
    """Kill ``ctx`` when the client disconnects (runs beside the response)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            ctx.kill()
            return


async def read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        body = message.get("body", b"")
        size += len(body)
        if size > MAX_BODY:
            raise HttpError(413, "invalid_request_error",
                            f"request body larger than {MAX_BODY} bytes", code="request_too_large")
        chunks.append(body)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def send_message(send: Send, message: dict[str, Any]) -> None:
    """``send(message)``; a connection that is gone raises ``ClientGone``."""
    try:
        await send(message)
    except (OSError, RuntimeError) as exc:  # the connection is gone
        raise ClientGone from exc


async def reply(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """A whole response (JSON unless ``headers`` say otherwise)."""
    start = {"type": "http.response.start", "status": status, "headers": headers or JSON}
    await send_message(send, start)
    await send_message(send, {"type": "http.response.body", "body": body, "more_body": False})


async def error(send: Send, exc: HttpError) -> None:
    """``exc`` in OpenAI's error shape (nothing if the client is already gone)."""
    with contextlib.suppress(ClientGone):
        await reply(send, exc.status, exc.to_json())
