"""One batch line sent through the frontend's own HTTP handlers, in process: the line becomes
an ASGI request to ``FrontendApp`` (no socket), so it gets the same parsing, preprocessing,
tenant admission, routing and migration as a client's request. It carries the lowest priority
(``x-dynamo-priority``: the largest value, which the router's busy queue and the engines serve
last), and its batch's tenant. ``halt`` set is the client going away: the request's context is
killed and its workers stop."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from ._priority import MAX_PRIORITY, PRIORITY_HEADER

__all__ = ["TENANT_KEY", "call_in_process"]

#: The ASGI scope key naming a batch line's tenant (``Tenants.identify`` reads it first).
TENANT_KEY = "dynamo.batch_tenant"

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


async def call_in_process(app: App, url: str, body: bytes, tenant: str | None,
                          halt: asyncio.Event) -> tuple[int, bytes]:
    """POST ``body`` to ``url`` on ``app``; the status and body it answered."""
    scope: dict[str, Any] = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": url, "raw_path": url.encode(), "query_string": b"",
        "root_path": "", "client": None, "server": None,
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (PRIORITY_HEADER, str(MAX_PRIORITY).encode())],
    }
    if tenant is not None:
        scope[TENANT_KEY] = tenant
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await halt.wait()
        return {"type": "http.disconnect"}

    status = 0
    chunks: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(chunks)
