"""W3C trace context across hops: the carrier a request takes over ZeroMQ (``wire.Request.trace``,
``{"traceparent": ..., "tracestate": ...}``), the ``traceparent`` of HTTP, and the
``traceparent``-formatted links of migrated and disaggregated requests. An absent or malformed
carrier means no parent (a new trace)."""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context as OtelContext
from opentelemetry.trace import SpanContext, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ._state import state

__all__ = ["extract", "outgoing", "parse_traceparent", "traceparent"]

_PROPAGATOR = TraceContextTextMapPropagator()


def outgoing() -> dict[str, str] | None:
    """The current span's context as a W3C carrier, for a request sent now; None when tracing
    is off or no span is current."""
    if not state.active:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier or None


def extract(carrier: Mapping[str, str] | None) -> OtelContext | None:
    """The parent context a received carrier names (None: none, or it does not parse)."""
    if not carrier:
        return None
    ctx = _PROPAGATOR.extract(carrier)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def traceparent(span_context: SpanContext) -> str:
    """``span_context`` as a W3C ``traceparent`` value."""
    return (f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-"
            f"{int(span_context.trace_flags):02x}")


def parse_traceparent(value: str | None) -> SpanContext | None:
    """The remote span context a ``traceparent`` value names (None: absent or malformed)."""
    if not value:
        return None
    parts = value.strip().split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags & 0xFF))
