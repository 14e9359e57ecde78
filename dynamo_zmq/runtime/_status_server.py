"""A small HTTP status server for a process: ``/metrics``, ``/health`` and ``/live``, on
Dynamo's *system port*.

Dynamo's convention: ``DYN_SYSTEM_PORT=N`` serves them on port N (a negative port: off), and
``DYN_SYSTEM_ENABLED=true`` without a port serves them on 8081; ``DYN_SYSTEM_ENABLED=false``
turns the server off. ``DYN_METRICS_PORT`` (this project's older name) is read when
``DYN_SYSTEM_PORT`` is not set.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..errors import InvalidArgument

__all__ = ["DEFAULT_SYSTEM_PORT", "StatusServer", "system_port_from_env"]

#: Dynamo's system port when ``DYN_SYSTEM_ENABLED=true`` names none.
DEFAULT_SYSTEM_PORT = 8081


def system_port_from_env(environ: Mapping[str, str] = os.environ) -> int | None:
    """The system port Dynamo's variables ask for; None: no system server.

    Raises:
        InvalidArgument: a port variable that is not an integer.
    """
    enabled = environ.get("DYN_SYSTEM_ENABLED", "").strip().lower()
    if enabled in ("0", "false", "no", "off"):
        return None
    for name in ("DYN_SYSTEM_PORT", "DYN_METRICS_PORT"):
        raw = environ.get(name, "").strip()
        if raw:
            try:
                port = int(raw)
            except ValueError:
                raise InvalidArgument(f"{name} must be a port number, got {raw!r}") from None
            return port if port >= 0 else None
    return DEFAULT_SYSTEM_PORT if enabled in ("1", "true", "yes", "on") else None


class StatusServer:
    """``GET /metrics``, ``/health`` (200 healthy / 503 not) and ``/live`` on a background
    thread."""

    def __init__(
        self,
        host: str,
        port: int,
        metrics: Callable[[], bytes],
        health: Callable[[], tuple[bool, dict[str, object]]],
    ) -> None:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/metrics":
                    self._reply(200, owner._metrics(), CONTENT_TYPE_LATEST)
                elif self.path == "/health":
                    ok, body = owner._health()
                    self._reply(200 if ok else 503, json.dumps(body).encode(), "application/json")
                elif self.path == "/live":
                    self._reply(200, b'{"status": "live"}', "application/json")
                else:
                    self._reply(404, b'{"error": "not found"}', "application/json")

            def _reply(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._metrics = metrics
        self._health = health
        try:
            self._httpd = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:  # the port is taken, the host is not ours...
            raise InvalidArgument(
                f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}"
            ) from exc
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="status-http", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
