"""The frontend's route table: every HTTP route it serves, with its methods.

``FrontendApp`` answers a path not in ``ROUTES`` with 404 and a method a route does not take
with 405 (in Anthropic's error shape on the Messages API's routes) before its dispatch, so a
route is served only once it is listed here; docs/operations.md's "Routes" table lists the same
routes (``tests/test_routes_docs.py`` checks both against each other and a running frontend).
A ``{name}`` segment of a path matches any one non-empty segment.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import errors as http_errors
from ._anthropic_errors import MESSAGES_ROUTES, anthropic_send
from ._asgi import Send, error
from .errors import HttpError

__all__ = ["ROUTES", "Route", "refuse", "route_of"]


@dataclass(frozen=True)
class Route:
    """A path (``{name}`` segments match any one segment) and the methods it takes."""

    path: str
    methods: tuple[str, ...]

    def matches(self, path: str) -> bool:
        ours, theirs = self.path.split("/"), path.split("/")
        return len(ours) == len(theirs) and all(
            o == t or (o.startswith("{") and o.endswith("}") and t != "")
            for o, t in zip(ours, theirs, strict=True))


_POST, _GET = ("POST",), ("GET",)
ROUTES = (
    Route("/v1/chat/completions", _POST),
    Route("/v1/completions", _POST),
    Route("/v1/embeddings", _POST),
    Route("/v1/responses", _POST),
    Route("/v1/responses/{id}", ("GET", "DELETE")),
    Route("/v1/messages", _POST),
    Route("/v1/messages/count_tokens", _POST),
    Route("/v1/files", ("POST", "GET")),
    Route("/v1/files/{id}", ("GET", "DELETE")),
    Route("/v1/files/{id}/content", _GET),
    Route("/v1/batches", ("POST", "GET")),
    Route("/v1/batches/{id}", _GET),
    Route("/v1/batches/{id}/cancel", _POST),
    Route("/v1/models", _GET),
    Route("/health", _GET),
    Route("/live", _GET),
    Route("/metrics", _GET),
    Route("/clear_kv_blocks", _POST),
    Route("/v1/load_lora_adapter", _POST),
    Route("/v1/unload_lora_adapter", _POST),
)
_EXACT = {r.path: r for r in ROUTES if "{" not in r.path}
_PATTERNS = [r for r in ROUTES if "{" in r.path]


def route_of(path: str) -> Route | None:
    """The route serving ``path`` (None: none)."""
    found = _EXACT.get(path)
    if found is not None:
        return found
    return next((r for r in _PATTERNS if r.matches(path)), None)


async def refuse(route: Route | None, method: str, path: str, send: Send) -> bool:
    """Answer 404 (no route) or 405 (a method ``route`` does not take); whether it did."""
    if route is None:
        await error(send, http_errors.not_found(f"no route {path}"))
        return True
    if method in route.methods:
        return False
    exc = HttpError(405, "invalid_request_error", f"{method} is not allowed on {path}")
    exc.headers = ((b"allow", ", ".join(route.methods).encode()),)
    await error(anthropic_send(send) if path in MESSAGES_ROUTES else send, exc)
    return True
