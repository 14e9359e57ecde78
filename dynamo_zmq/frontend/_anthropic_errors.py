"""Errors of the Anthropic Messages API routes in Anthropic's shape.

Every error the frontend answers (``_asgi.error``: OpenAI's ``{"error": {...}}``) on
``/v1/messages`` and ``/v1/messages/count_tokens`` is rewritten on its way out by
``anthropic_send`` into Anthropic's::

    {"type": "error", "error": {"type": "not_found_error", "message": "..."}}

with the same HTTP status, the type chosen by status as Anthropic's API does (``ERROR_TYPES``;
any other 5xx is ``api_error``). So the routes' own refusals, the API-key guard's 401, a
tenant's 429, the deadline's 504 and a worker's failure all reach an Anthropic client in the
shape its SDK parses.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ._asgi import Send
from .errors import HttpError

__all__ = ["ERROR_TYPES", "MESSAGES_ROUTES", "anthropic_error", "anthropic_send",
           "error_type"]

#: The routes of the Messages API.
MESSAGES_ROUTES = ("/v1/messages", "/v1/messages/count_tokens")

#: HTTP status -> Anthropic's error type.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    found = ERROR_TYPES.get(status)
    if found is not None:
        return found
    return "api_error" if status >= 500 else "invalid_request_error"


def anthropic_error(status: int, message: str) -> bytes:
    """An Anthropic error body."""
    body = {"type": "error", "error": {"type": error_type(status), "message": message}}
    return msgspec.json.encode(body)


def from_http_error(exc: HttpError) -> bytes:
    """``exc`` as an Anthropic error body."""
    return anthropic_error(exc.status, exc.message)


def _rewrite(body: bytes, status: int) -> bytes:
    """An OpenAI error body as Anthropic's (anything else as the message of one)."""
    try:
        decoded: Any = msgspec.json.decode(body)
        message = decoded["error"]["message"]
    except (msgspec.DecodeError, KeyError, TypeError):
        message = body.decode("utf-8", "replace")
    return anthropic_error(status, str(message))


def anthropic_send(send: Send) -> Send:
    """``send`` that rewrites an error response's body (status 400 and over) into Anthropic's
    shape; successful responses pass unchanged."""
    status = 0

    async def wrapped(message: dict[str, Any]) -> None:
        nonlocal status
        kind = message["type"]
        if kind == "http.response.start":
            status = message["status"]
        elif kind == "http.response.body" and status >= 400:
            message = {**message, "body": _rewrite(message.get("body", b""), status)}
        await send(message)

    return wrapped
