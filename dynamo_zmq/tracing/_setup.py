"""Process set-up: a TracerProvider when ``OTEL_EXPORT_ENABLED=1`` (spans exported over
OTLP/HTTP through a BatchSpanProcessor) or ``DYN_LOGGING_JSONL=1`` (spans kept local, so that
log records carry their ids); neither: nothing is made and every helper is a no-op."""

from __future__ import annotations

import atexit
import logging
import os

from ._state import state

__all__ = ["env_flag", "setup", "shutdown"]

log = logging.getLogger(__name__)


def env_flag(name: str) -> bool:
    """``name`` is set to 1/true/yes/on (any case)."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def setup(default_service: str) -> bool:
    """Configure tracing for this process from the environment (once; later calls do nothing).
    ``default_service``: the ``service.name`` unless ``OTEL_SERVICE_NAME`` is set. The OTLP
    endpoint is the exporter's standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` (default ``http://localhost:4318``). Returns whether spans
    are made."""
    if state.provider is not None:
        return state.active
    export = env_flag("OTEL_EXPORT_ENABLED")
    if not (export or env_flag("DYN_LOGGING_JSONL")):
        return False
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    service = os.environ.get("OTEL_SERVICE_NAME") or default_service
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if export:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    state.provider = provider
    state.tracer = provider.get_tracer("dynamo_zmq")
    state.export = export
    state.active = True
    atexit.register(shutdown)
    log.info("tracing on as %r (OTLP export %s)", service, "on" if export else "off")
    return True


def shutdown() -> None:
    """Flush the spans not exported yet and stop exporting (idempotent)."""
    provider = state.provider
    if provider is None or not state.active:
        return
    state.active = False
    try:
        provider.shutdown()
    except Exception:  # an unreachable collector must not fail the process's exit
        log.warning("flushing the trace exporter failed", exc_info=True)
