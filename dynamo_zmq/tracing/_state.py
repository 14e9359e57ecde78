"""The process's tracing state: whether spans are made at all, and the tracer that makes them.

Read once by ``setup``; every helper checks ``state.active`` first, so with tracing off (the
default) they return at once and the per-chunk paths are never entered."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Tracer


class _State:
    __slots__ = ("active", "export", "provider", "tracer")

    def __init__(self) -> None:
        #: Spans are made (OTLP export on, or JSON-lines logs that carry trace ids).
        self.active = False
        #: Finished spans go to the OTLP exporter.
        self.export = False
        self.provider: TracerProvider | None = None
        self.tracer: Tracer | None = None


state = _State()
