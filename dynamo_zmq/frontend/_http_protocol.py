"""uvicorn's httptools protocol with a deadline on request headers.

uvicorn bounds the wait between requests on a kept-alive connection (``timeout_keep_alive``)
but not a connection that never sends its request line, nor headers that never end: such a
connection would stay open for ever. ``header_timeout_protocol(seconds)`` gives uvicorn a
protocol class that answers 408 in OpenAI's error shape and closes the connection when a
request's headers have not all arrived ``seconds`` after the connection opened or the request
began. The body has its own deadline (``_asgi.read_body``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .errors import HttpError

__all__ = ["header_timeout_protocol"]


class _HeaderDeadline(HttpToolsProtocol):
    """``HttpToolsProtocol`` that arms a timer until each request's headers are complete."""

    header_timeout = 30.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm()  # a response is still being written: not the moment to cut in
            return
        seconds = f"{self.header_timeout:g}"
        body = HttpError(408, "invalid_request_error",
                         f"the request headers did not arrive within {seconds} s",
                         code="request_timeout").to_json()
        self.transport.write(
            b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
        )
        self.transport.close()


def header_timeout_protocol(seconds: float) -> type[Any]:
    """The protocol class to give ``uvicorn.Config(http=...)``: httptools, with a ``seconds``
    deadline on each request's headers."""
    return type("HeaderDeadlineProtocol", (_HeaderDeadline,), {"header_timeout": seconds})
