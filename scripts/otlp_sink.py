"""A local OTLP/HTTP trace sink for benchmarks: accepts ``POST /v1/traces`` on loopback, keeps
the raw bodies and answers at once, so the exporting processes pay their full cost while the
sink itself does almost no work during the run. On SIGINT/SIGTERM it decodes what it got and
prints one line: requests, bytes and spans received.

    python scripts/otlp_sink.py [--port 4318]

Point processes at it with ``OTEL_EXPORT_ENABLED=1
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=http://127.0.0.1:4318/v1/traces``.
"""

from __future__ import annotations

import argparse
import gzip
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

_EMPTY = ExportTraceServiceResponse().SerializeToString()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=4318)
    args = ap.parse_args()
    bodies: list[tuple[bytes, bool]] = []
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            with lock:
                bodies.append((body, self.headers.get("Content-Encoding") == "gzip"))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(_EMPTY)))
            self.end_headers()
            self.wfile.write(_EMPTY)

        def log_message(self, *a: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print(f"otlp sink on http://127.0.0.1:{args.port}/v1/traces", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    spans = 0
    for body, gz in bodies:
        req = ExportTraceServiceRequest()
        req.ParseFromString(gzip.decompress(body) if gz else body)
        spans += sum(len(s.spans) for r in req.resource_spans for s in r.scope_spans)
    size = sum(len(b) for b, _ in bodies)
    print(f"otlp sink: {len(bodies)} requests, {size} bytes, {spans} spans", flush=True)


if __name__ == "__main__":
    main()
