"""The worker's ``engine.generate`` span: a child of ``handle_payload`` around the engine's
stream, current while the engine runs (so the engine's own spans nest under it), with the
backend-common document's attributes: ``model``, ``input_tokens``, ``disagg_role`` at entry;
``ttft_ms``, ``output_tokens``, ``finish_reason``, ``cancelled``, ``avg_itl_ms``,
``itl_p50_ms``, ``itl_p99_ms``, ``itl_max_ms`` at the end; ``error_kind`` and an error status
on failure; a link to the predecessor named by ``request.migration_link`` (a migrated
request's first worker, a disaggregated decode's prefill), with ``migration_trace_id`` and
``migration_span_id``. Only used with tracing on: off, the worker iterates the engine's own
stream and nothing here runs."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, Span, Status, StatusCode

from .. import errors
from ..context import Context
from ..llm import FinishReason, LLMEngineOutput, PrefillRemotely, PreprocessedRequest
from ..tracing import parse_traceparent, state, traceparent
from ._stream_stats import StreamStats

__all__ = ["trace_engine"]

log = logging.getLogger("dynamo_zmq.tracing")


def trace_engine(
    stream: AsyncIterator[LLMEngineOutput],
    request: PreprocessedRequest,
    ctx: Context,
    role: str,
    postprocessed: bool,
) -> tuple[AsyncIterator[LLMEngineOutput], str | None]:
    """``stream`` under an ``engine.generate`` span, and the span's ``traceparent`` (the
    ``worker_trace_link`` the worker stamps on its first output with tokens). With tracing off:
    ``(stream, None)``, untouched. ``postprocessed``: the worker post-processes the outputs
    (a ``postprocess`` span covers the stream too)."""
    tracer = state.tracer
    if not state.active or tracer is None:
        return stream, None
    links: list[Link] = []
    attrs: dict[str, Any] = {
        "model": request.model, "input_tokens": len(request.token_ids), "disagg_role": role,
        "request_id": ctx.id(),
    }
    pred = parse_traceparent(request.migration_link)
    if pred is not None:
        remote = isinstance(request.disaggregation, PrefillRemotely)
        kind = "worker_trace_link" if remote else "migration_link"
        links.append(Link(pred, {"link.kind": kind}))
        attrs["migration_trace_id"] = f"{pred.trace_id:032x}"
        attrs["migration_span_id"] = f"{pred.span_id:016x}"
    span = tracer.start_span("engine.generate", links=links, attributes=attrs)
    post = None
    if postprocessed:
        post = tracer.start_span("postprocess", attributes={
            "detokenize": True, "stop_strings": len(request.stop.stop),
            "tools": request.tools is not None, "reasoning": request.reasoning,
            "resumed_tokens": request.resume.generated if request.resume else 0,
        })
    return _traced(stream, span, post, ctx), traceparent(span.get_span_context())


async def _traced(
    stream: AsyncIterator[LLMEngineOutput], span: Span, post: Span | None, ctx: Context
) -> AsyncIterator[LLMEngineOutput]:
    stats = StreamStats()
    current = trace.set_span_in_context(span)
    it = stream.__aiter__()
    finish: str | None = None
    try:
        while True:
            token = otel_context.attach(current)  # the engine's code runs under the span
            try:
                out = await it.__anext__()
            except StopAsyncIteration:
                break
            finally:
                otel_context.detach(token)
            if out.token_ids:
                stats.note(len(out.token_ids))
            if out.finish_reason is not None:
                finish = out.finish_reason
                if finish == FinishReason.ERROR:
                    span.set_attribute("error_kind", "EngineError")
                    span.set_status(Status(StatusCode.ERROR, out.error or "error terminal"))
            yield out
    except BaseException as exc:
        if isinstance(exc, Exception):
            kind = errors.from_exception(exc).kind
            span.set_attribute("error_kind", kind)
            span.set_status(Status(StatusCode.ERROR, f"{kind}: {exc}"))
            span.record_exception(exc)
        raise
    finally:
        attrs = stats.attributes()
        cancelled = ctx.is_stopped() or finish == FinishReason.CANCELLED
        attrs.update(finish_reason=finish or "", cancelled=cancelled)
        span.set_attributes(attrs)
        token = otel_context.attach(current)
        try:
            log.debug("engine.generate of request %s ended: %s, %d tokens", ctx.id(),
                      finish or "no terminal", stats.output_tokens)
        finally:
            otel_context.detach(token)
        span.end()
        if post is not None:
            post.end()
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()
