"""ASGI plumbing the frontend's routes share: reading a body, replying, errors in OpenAI's
shape, and noticing that the client went away."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from ..context import Context
from ._limits import HttpLimits
from .errors import HttpError, body_timeout, body_too_large

__all__ = [
    "JSON",
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

JSON = [(b"content-type", b"application/json")]
_CLOSE = [*JSON, (b"connection", b"close")]
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


async def read_body(receive: Receive, scope: Scope, limits: HttpLimits) -> bytes:
    """The request's whole body, within ``limits`` (size, and time to arrive).

    Raises:
        ClientGone: the client disconnected first.
        HttpError: 413 for a body (or a ``Content-Length``) over ``limits.max_body``, 408 when
            it did not arrive within ``limits.body_timeout``; both close the connection.
    """
    max_body = limits.max_body
    length = header(scope, b"content-length")
    if length is not None and length.isdigit() and int(length) > max_body:
        raise body_too_large(max_body)
    try:
        async with asyncio.timeout(limits.body_timeout):
            return await _read(receive, max_body)
    except TimeoutError:
        raise body_timeout(limits.body_timeout or 0.0) from None


async def _read(receive: Receive, max_body: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        body = message.get("body", b"")
        size += len(body)
        if size > max_body:
            raise body_too_large(max_body)
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
    """``exc`` in OpenAI's error shape (nothing if the client is already gone); the connection
    is closed after it when ``exc.close`` (a body left unread); ``Retry-After`` when
    ``exc.retry_after`` is set; and ``exc.headers``."""
    headers = _CLOSE if exc.close else None
    if exc.retry_after is not None:
        headers = [*(headers or JSON), (b"retry-after", str(exc.retry_after).encode())]
    if exc.headers:
        headers = [*(headers or JSON), *exc.headers]
    with contextlib.suppress(ClientGone):
        await reply(send, exc.status, exc.to_json(), headers)
