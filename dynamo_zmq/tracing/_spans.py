"""Span helpers the runtime and frontend call: a span around a block, the runtime's
request-handling span (``handle_payload``) around a served request, and ``engine_span``, the
public helper for an engine's own spans. With tracing off each returns a shared no-op at once."""

from __future__ import annotations

import contextlib
from collections.abc import Coroutine, Iterator, Mapping
from typing import Any, TypeVar

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind

from ._propagation import extract
from ._state import state

__all__ = ["engine_span", "handled", "span"]

T = TypeVar("T")
_NOOP: contextlib.nullcontext[None] = contextlib.nullcontext()


def span(name: str, **attributes: Any) -> contextlib.AbstractContextManager[Span | None]:
    """A child span of the current one around a ``with`` block (``None`` attribute values are
    left out); with tracing off, a no-op yielding None."""
    tracer = state.tracer
    if not state.active or tracer is None:
        return _NOOP
    attrs = {k: v for k, v in attributes.items() if v is not None}
    return tracer.start_as_current_span(name, attributes=attrs)


@contextlib.contextmanager
def engine_span(name: str, **attributes: Any) -> Iterator[Span | None]:
    """For engines: a span of their own, named at run time, under the current one (inside
    ``LLMEngine.generate`` that is ``engine.generate``). Yields the span (None with tracing
    off) so the engine can add attributes; ends it, and marks it failed if the block raises.

        with engine_span(f"kv_load_rank_{rank}", blocks=8) as sp:
            ...
    """
    with span(name, **attributes) as sp:
        yield sp


async def _handled(
    coro: Coroutine[Any, Any, T], carrier: Mapping[str, str], endpoint: str, request_id: str
) -> T:
    tracer = state.tracer
    assert tracer is not None
    with tracer.start_as_current_span(
        "handle_payload", context=extract(carrier), kind=SpanKind.SERVER,
        attributes={"endpoint": endpoint, "request_id": request_id},
    ):
        return await coro


def handled(
    coro: Coroutine[Any, Any, T], carrier: Mapping[str, str] | None, endpoint: str,
    request_id: str,
) -> Coroutine[Any, Any, T]:
    """``coro`` (a served request's task) run under a ``handle_payload`` span, the child of the
    caller's span ``carrier`` names (a new trace without one); ``coro`` itself when tracing is
    off."""
    if not state.active:
        return coro
    return _handled(coro, carrier or {}, endpoint, request_id)


def current_ids() -> tuple[str, str] | None:
    """The current span's (trace id, span id) in hex, or None."""
    if not state.active:
        return None
    sc = trace.get_current_span().get_span_context()
    if not sc.is_valid:
        return None
    return f"{sc.trace_id:032x}", f"{sc.span_id:016x}"
