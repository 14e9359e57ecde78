"""A local OTLP/HTTP trace receiver for tests: a tiny HTTP server on loopback that decodes each
``ExportTraceServiceRequest`` (protobuf, ``POST /v1/traces``) real processes export to it and
keeps the spans, flattened into ``Span`` records."""

from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    #: (trace id, span id, attributes) of each link.
    links: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    status_error: bool = False


class OtlpReceiver:
    """``with OtlpReceiver() as rx:`` serves on 127.0.0.1; ``rx.endpoint`` is the traces URL."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.posts = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver._take(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _take(self, req: ExportTraceServiceRequest) -> None:
        got = []
        for rs in req.resource_spans:
            attrs = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Span(
                        str(attrs.get("service.name", "")), s.name, s.trace_id.hex(),
                        s.span_id.hex(), s.parent_span_id.hex(),
                        {a.key: _value(a.value) for a in s.attributes},
                        [(ln.trace_id.hex(), ln.span_id.hex(),
                          {a.key: _value(a.value) for a in ln.attributes}) for ln in s.links],
                        s.status.code == 2,
                    ))
        with self._lock:
            self.spans.extend(got)
            self.posts += 1

    def env(self) -> dict[str, str]:
        """The environment that makes a process export here, promptly."""
        return {"OTEL_EXPORT_ENABLED": "1", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": self.endpoint,
                "OTEL_BSP_SCHEDULE_DELAY": "100"}

    def wait_for(self, pred: Any, timeout: float = 30.0) -> list[Span]:
        """Spans received, once ``pred(spans)`` holds (AssertionError at the deadline)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = list(self.spans)
            if pred(spans):
                return spans
            assert time.monotonic() < deadline, [(s.service, s.name) for s in spans]
            time.sleep(0.05)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
