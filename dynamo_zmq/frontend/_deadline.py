"""The whole-request deadline: ``--request-timeout`` and the ``x-dynamo-request-timeout`` header.

A request's deadline bounds it from routing to its last byte, however steadily its tokens come
(the idle time between outputs is ``--idle-timeout``'s, separately). When it passes, the
frontend kills the request's context, so the worker's context stops and the engine frees the
sequence, and the client gets 504 (or, after the first SSE chunk, an error event). The same
number travels with the request as the runtime's per-request ``timeout``, so the worker enforces
it too (``ResponseTimeout``, also 504).
"""

from __future__ import annotations

import asyncio
import math

from ..context import Context
from ._asgi import Scope, header
from .errors import HttpError, bad_request, timeout

__all__ = ["TIMEOUT_HEADER", "Deadline", "request_timeout"]

#: Request header: this request's deadline in seconds (at most the frontend's
#: ``--request-timeout``, when that is set).
TIMEOUT_HEADER = b"x-dynamo-request-timeout"


def request_timeout(scope: Scope, default: float | None) -> float | None:
    """The deadline of the request in ``scope``: its header's, capped at ``default``, else
    ``default`` (None: no deadline).

    Raises:
        HttpError: 400 when the header is not a finite number of seconds > 0.
    """
    raw = header(scope, TIMEOUT_HEADER)
    if raw is None:
        return default
    try:
        seconds = float(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise bad_request(
            f"{TIMEOUT_HEADER.decode()}: {raw[:40]!r} is not a number of seconds > 0",
            code="invalid_value",
        )
    return seconds if default is None else min(seconds, default)


class Deadline:
    """Kills ``ctx`` ``seconds`` from now. ``expired`` tells a request that ran out of time
    from one whose client went away (both end its stream with ``Cancelled``).

    Args:
        ctx: the request's context.
        seconds: the time the request has.
    """

    __slots__ = ("_ctx", "_fired", "_handle", "_loop", "seconds")

    def __init__(self, ctx: Context, seconds: float) -> None:
        self.seconds = seconds
        self._fired = False
        self._ctx = ctx
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_later(seconds, self._fire)

    @property
    def expired(self) -> bool:
        """The time is up (even if the timer has not run yet: a busy loop runs it late)."""
        return self._fired or self._loop.time() >= self._handle.when()

    def _fire(self) -> None:
        self._fired = True
        self._ctx.kill()

    def cancel(self) -> None:
        """The request is over: the deadline no longer applies."""
        self._handle.cancel()

    def error(self) -> HttpError:
        """The 504 the client gets."""
        return timeout(f"The request did not complete within its {self.seconds:g} s deadline.")
