"""``RequestScope``: one HTTP request's life on the frontend, for chat, completions (one
choice or many) and embeddings alike. It owns the request's ``Context``, the task that watches
for the client's disconnect, the deadline, the request metrics and the teardown, in that order
in and reverse order out:

    async with RequestScope(...) as request_scope:
        stream = await router.generate(request, request_scope.ctx, request_scope.options)
        ...
        request_scope.status = "success"

A client that goes away (``ClientGone``) ends the block quietly: the context is killed (the
workers stop) and the request is counted ``disconnected``. The frontend's shutdown ends the
requests still open when its grace is over (``InFlight.end_all``): their context is killed and
``ending`` says why, so a stream ends with a retryable 503 error event and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType
from typing import TYPE_CHECKING

from .. import errors
from ..context import Context
from ..llm import RouteOptions
from ..resources import cancel_and_wait
from . import errors as http_errors
from ._asgi import ClientGone, Receive, Send, error, watch_disconnect
from ._deadline import Deadline
from .metrics import FrontendMetrics

if TYPE_CHECKING:
    from ._tenants import Ticket

__all__ = ["InFlight", "RequestScope"]


class InFlight:
    """The requests a frontend has open (their scopes), for its shutdown to end."""

    def __init__(self) -> None:
        self._scopes: set[RequestScope] = set()

    def __len__(self) -> int:
        return len(self._scopes)

    def add(self, scope: RequestScope) -> None:
        self._scopes.add(scope)

    def discard(self, scope: RequestScope) -> None:
        self._scopes.discard(scope)

    def end_all(self) -> int:
        """End every open request (the shutdown's grace is over); how many there were."""
        scopes = list(self._scopes)
        for scope in scopes:
            scope.end_for_shutdown()
        return len(scopes)


class RequestScope:
    """See the module docstring.

    Args:
        metrics: the frontend's metrics.
        model: the model's name (label).
        endpoint: ``chat``, ``completions``, ``embeddings`` or ``responses`` (label).
        streaming: an SSE response (label ``stream``; else ``unary``).
        request_id: the request's id (its ``Context`` id).
        receive: the ASGI receive channel (watched for the disconnect).
        options: how to route the request (its ``timeout`` is the request's deadline).
        prompt_tokens: the prompt's tokens (input sequence length metric).
        in_flight: the frontend's open requests, this one among them while the block runs.
    """

    def __init__(self, metrics: FrontendMetrics, model: str, endpoint: str, streaming: bool,
                 request_id: str, receive: Receive, options: RouteOptions,
                 prompt_tokens: int, in_flight: InFlight | None = None) -> None:
        self.metrics, self.model, self.endpoint = metrics, model, endpoint
        self.streaming = streaming
        self.options = options
        self.ctx = Context(request_id)
        #: How the request ended (label): set by the code inside the block; ``error`` unless
        #: it says otherwise.
        self.status = "error"
        self.started = 0.0
        self.deadline: Deadline | None = None
        self._receive = receive
        self.prompt_tokens = prompt_tokens
        #: Tokens generated and seconds to the first, as the code inside the block saw them
        #: (for the tenant's settlement).
        self.completion_tokens = 0
        self.ttft: float | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._in_flight = in_flight
        self._shut_down = False

    async def __aenter__(self) -> RequestScope:
        m = self.metrics
        m.inflight.labels(self.model).inc()
        m.isl.labels(self.model).observe(self.prompt_tokens)
        self._watcher = asyncio.create_task(watch_disconnect(self._receive, self.ctx),
                                            name=f"disconnect-{self.ctx.id()}")
        self.started = time.monotonic()
        if self.options.timeout is not None:
            self.deadline = Deadline(self.ctx, self.options.timeout)
        if self._in_flight is not None:
            self._in_flight.add(self)
        return self

    async def __aexit__(self, typ: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool:
        if self._in_flight is not None:
            self._in_flight.discard(self)
        gone = isinstance(exc, ClientGone)
        if gone:
            self.ctx.kill()
            self.status = "disconnected"
        if self.deadline is not None:
            self.deadline.cancel()
        if self._watcher is not None:
            await cancel_and_wait((self._watcher,))
        m, model = self.metrics, self.model
        if self.status == "disconnected" or (
            self.ctx.is_killed() and self.status != "success" and self.ending() is None
        ):
            m.disconnected.labels(model).inc()
            self.status = "disconnected"
        mode = "stream" if self.streaming else "unary"
        m.requests.labels(model, self.endpoint, mode, self.status).inc()
        m.inflight.labels(model).dec()
        m.duration.labels(model).observe(time.monotonic() - self.started)
        return gone

    def settle(self, ticket: Ticket | None) -> None:
        """Settle the tenant's reservation (after the block: ``status`` is final)."""
        if ticket is not None:
            ticket.settle(self.status, self.prompt_tokens, self.completion_tokens, self.ttft)

    def end_for_shutdown(self) -> None:
        """The frontend's shutdown grace is over: end the request (``ending`` says why)."""
        self._shut_down = True
        self.ctx.kill()

    def ending(self) -> http_errors.HttpError | None:
        """Why the frontend itself ended the request: the deadline's 504, the shutdown's
        retryable 503; None when it did not (a killed context then means the client left)."""
        if self.deadline is not None and self.deadline.expired:
            return self.deadline.error()
        if self._shut_down:
            return http_errors.shutting_down()
        return None

    async def fail(self, send: Send, exc: errors.DynamoError) -> None:
        """Answer a request that failed before its response began: 504 past its deadline,
        503 at shutdown, nothing to a client that is gone, else the error's own status."""
        if (why := self.ending()) is not None:
            await error(send, why)
        elif not self.ctx.is_killed():
            await error(send, http_errors.from_dynamo(exc))
