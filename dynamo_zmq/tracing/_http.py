"""The frontend's HTTP span: ASGI middleware that opens a server span per HTTP request, the
child of the client's W3C ``traceparent`` (and ``tracestate``) when it sent one, and returns
the span's ``traceparent`` in the response headers. Installed only with tracing on."""

from __future__ import annotations

import logging
from typing import Any

from opentelemetry.trace import SpanKind, Status, StatusCode

from ._propagation import extract, traceparent
from ._state import state

__all__ = ["TracingMiddleware", "wrap_asgi"]

log = logging.getLogger("dynamo_zmq.tracing")

Scope = dict[str, Any]
ASGIApp = Any
_CARRIED = (b"traceparent", b"tracestate")
#: Probes and scrapes: polled all the time, and no request's story.
_UNTRACED = frozenset({"/metrics", "/health", "/live"})


class TracingMiddleware:
    """Wraps an ASGI app: every ``http`` request (but ``/metrics``, ``/health`` and ``/live``)
    runs under an ``http.request`` span."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        tracer = state.tracer
        if (scope["type"] != "http" or not state.active or tracer is None
                or scope.get("path") in _UNTRACED):
            await self.app(scope, receive, send)
            return
        carrier = {k.decode("latin-1"): v.decode("latin-1")
                   for k, v in scope.get("headers", ()) if k in _CARRIED}
        method, path = scope.get("method", ""), scope.get("path", "")
        with tracer.start_as_current_span(
            "http.request", context=extract(carrier), kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path},
        ) as span:
            header = traceparent(span.get_span_context()).encode()

            async def send_traced(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    status = int(message.get("status", 200))
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
                    message = {**message,
                               "headers": [*message.get("headers", ()), (b"traceparent", header)]}
                await send(message)

            await self.app(scope, receive, send_traced)
            log.debug("%s %s handled", method, path)


def wrap_asgi(app: ASGIApp) -> ASGIApp:
    """``app`` under ``TracingMiddleware`` when tracing is on, else ``app`` itself."""
    return TracingMiddleware(app) if state.active else app
