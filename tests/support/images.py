"""Images for tests: tiny PNGs built by hand (zlib, no imaging library), data URLs, and a
local HTTP server that serves fixed files from a thread (stopped on exit)."""

from __future__ import annotations

import base64
import contextlib
import http.server
import struct
import threading
import zlib
from collections.abc import Iterator

__all__ = ["data_url", "png", "serve_files"]


def png(color: tuple[int, int, int] = (255, 0, 0), size: int = 2) -> bytes:
    """A ``size`` x ``size`` PNG of one RGB color."""
    row = b"\x00" + bytes(color) * size
    raw = row * size

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw))
            + chunk(b"IEND", b""))


def data_url(data: bytes, mime: str = "image/png") -> str:
    """``data:MIME;base64,...`` of ``data``."""
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@contextlib.contextmanager
def serve_files(files: dict[str, tuple[str, bytes]]) -> Iterator[str]:
    """Serve ``files`` (path -> (content type, body); others 404) on loopback from a thread;
    yields ``http://127.0.0.1:PORT``."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            found = files.get(self.path)
            if found is None:
                self.send_error(404)
                return
            kind, body = found
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
