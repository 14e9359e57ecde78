"""OpenTelemetry tracing across every hop (the backend-common document's telemetry): the HTTP
request and its preprocessing and routing on the frontend, W3C trace context carried in the
request over ZeroMQ, the runtime's ``handle_payload`` span and ``engine.generate`` on the
worker, links for migrated and disaggregated requests, OTLP export behind
``OTEL_EXPORT_ENABLED=1``, and JSON-lines logs that carry trace ids (``DYN_LOGGING_JSONL=1``).
docs/observability.md has the spans, their attributes and the environment variables.

Engines open their own spans under ``engine.generate`` with ``engine_span``.
"""

from __future__ import annotations

from ._http import wrap_asgi
from ._propagation import extract, outgoing, parse_traceparent, traceparent
from ._setup import env_flag, setup, shutdown
from ._spans import current_ids, engine_span, handled, span
from ._state import state

__all__ = [
    "current_ids",
    "engine_span",
    "env_flag",
    "extract",
    "handled",
    "outgoing",
    "parse_traceparent",
    "setup",
    "shutdown",
    "span",
    "state",
    "traceparent",
    "wrap_asgi",
]
