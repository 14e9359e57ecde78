"""HTTP errors of the frontend, in OpenAI's JSON shape, and the mapping from typed Dynamo errors.

Every failure a client sees is an ``HttpError``; its body is exactly OpenAI's::

    {"error": {"message": "...", "type": "invalid_request_error", "param": null, "code": null}}

    status  type                       when
    400     invalid_request_error      malformed JSON, wrong types, bad values, unsupported options
    404     invalid_request_error      unknown model (code ``model_not_found``, as OpenAI sends it),
                                       or a LoRA adapter the worker no longer holds
    404     not_found_error            unknown route
    408     invalid_request_error      the body did not arrive in time (``--body-timeout``)
    413     invalid_request_error      prompt too long (code ``context_length_exceeded``), or
                                       the body over ``--max-body-bytes``
    499     client_closed_request      the client went away (or the request was cancelled)
    503     service_unavailable_error  no live worker, or the worker is draining, or every worker
                                       is busy (code ``overloaded``, with ``Retry-After``)
    504     timeout_error              connecting or waiting for the next token took too long
    500     server_error               the engine failed, or anything unexpected

``from_dynamo`` is the one place where ``dynamo_zmq.errors.DynamoError`` becomes an HTTP status.
"""

from __future__ import annotations

import math
import re

import msgspec

from .. import errors

__all__ = [
    "HttpError",
    "bad_request",
    "body_timeout",
    "body_too_large",
    "client_closed",
    "embeddings_only",
    "engine_error",
    "engine_lacks",
    "from_dynamo",
    "from_exception",
    "model_not_found",
    "no_worker",
    "not_found",
    "prompt_too_long",
    "shutting_down",
    "timeout",
    "unsupported",
]

INVALID_REQUEST = "invalid_request_error"


class _ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class _ErrorEnvelope(msgspec.Struct):
    error: _ErrorBody


_encode = msgspec.json.Encoder().encode


class HttpError(Exception):
    """An error answered to the client with ``status`` and OpenAI's error body.

    Args:
        status: the HTTP status code.
        type: OpenAI's error type, e.g. ``invalid_request_error``.
        message: human-readable text for the client.
        code: OpenAI's machine-readable code, e.g. ``context_length_exceeded``.
        param: the request field at fault, e.g. ``temperature``.

    Attributes:
        close: close the connection after answering (the request's body was left unread).
        retry_after: whole seconds for a ``Retry-After`` header (None: no header).
    """

    close = False
    retry_after: int | None = None

    def __init__(
        self,
        status: int,
        type: str,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.message = message
        self.code = code
        self.param = param

    def __repr__(self) -> str:
        return (
            f"HttpError(status={self.status}, type={self.type!r}, message={self.message!r}, "
            f"code={self.code!r}, param={self.param!r})"
        )

    def to_json(self) -> bytes:
        """The response body: ``{"error": {"message", "type", "param", "code"}}``."""
        body = _ErrorBody(self.message, self.type, self.param, self.code)
        return _encode(_ErrorEnvelope(body))


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> HttpError:
    """400: the request is malformed or has a bad value."""
    return HttpError(400, INVALID_REQUEST, message, code=code, param=param)


def body_too_large(limit: int) -> HttpError:
    """413: the request body is larger than ``limit`` bytes (the connection is closed)."""
    err = HttpError(413, INVALID_REQUEST, f"request body larger than {limit} bytes",
                    code="request_too_large")
    err.close = True
    return err


def body_timeout(seconds: float) -> HttpError:
    """408: the request body did not arrive within ``seconds`` (the connection is closed)."""
    err = HttpError(408, INVALID_REQUEST, f"the request body did not arrive within {seconds:g} s",
                    code="request_timeout")
    err.close = True
    return err


def unsupported(param: str, detail: str = "") -> HttpError:
    """400: a valid OpenAI option this server does not support yet (never silently ignored)."""
    message = f"'{param}' is not supported yet" + (f": {detail}" if detail else "")
    return HttpError(400, INVALID_REQUEST, message, code="unsupported_parameter", param=param)


def engine_lacks(model: str, engine: str, param: str, capability: str) -> HttpError:
    """400: the engine serving ``model`` cannot do what ``param`` asks (``capability``)."""
    who = f"the {engine} engine" if engine else "its engine"
    message = (f"'{param}' needs {capability.replace('_', ' ')}, which {who} serving model "
               f"'{model}' does not support")
    return HttpError(400, INVALID_REQUEST, message, code="unsupported_parameter", param=param)


def embeddings_only(model: str, engine: str) -> HttpError:
    """400: ``model`` is an embedding model (its engine cannot generate)."""
    who = f"the {engine} engine" if engine else "its engine"
    message = (f"model '{model}' is an embedding model ({who} serves it for /v1/embeddings "
               "only): it cannot generate chat or text completions")
    return HttpError(400, INVALID_REQUEST, message, code="model_not_supported", param="model")


def model_not_found(model: str) -> HttpError:
    """404: no model of that name is served (a long name is cut in the message)."""
    if len(model) > 256:
        model = model[:256] + "..."
    return HttpError(
        404,
        INVALID_REQUEST,
        f"The model `{model}` does not exist.",
        code="model_not_found",
        param="model",
    )


def not_found(message: str) -> HttpError:
    """404: no such route or resource (unknown models use ``model_not_found``)."""
    return HttpError(404, "not_found_error", message, code="not_found")


def prompt_too_long(message: str, *, param: str | None = None) -> HttpError:
    """413: the prompt (or prompt plus ``max_tokens``) exceeds the model's context length."""
    return HttpError(413, INVALID_REQUEST, message, code="context_length_exceeded", param=param)


def client_closed(message: str = "The client closed the request.") -> HttpError:
    """499: the client disconnected, or the request was cancelled."""
    return HttpError(499, "client_closed_request", message, code="client_closed_request")


def no_worker(message: str = "No worker is available to serve the request.") -> HttpError:
    """503: no live worker serves the model, or it is shutting down."""
    return HttpError(503, "service_unavailable_error", message, code="service_unavailable")


def shutting_down() -> HttpError:
    """503: the frontend is shutting down and its grace for open requests is over (retry)."""
    return HttpError(
        503, "service_unavailable_error",
        "The frontend is shutting down: retry the request (another frontend serves it).",
        code="frontend_shutdown",
    )


def timeout(message: str = "The request timed out.") -> HttpError:
    """504: connecting, or waiting for the next response, exceeded its deadline."""
    return HttpError(504, "timeout_error", message, code="timeout")


def engine_error(message: str = "The engine failed to process the request.") -> HttpError:
    """500: the engine (or the server) failed."""
    return HttpError(500, "server_error", message, code="internal_error")


def _snake(kind: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", kind).lower()


def from_dynamo(exc: errors.DynamoError) -> HttpError:
    """Map a typed Dynamo error to its HTTP error; the code names the Dynamo kind.

    ``InvalidArgument`` -> 400; ``CannotConnect``, ``EngineShutdown``, ``Disconnected``,
    ``Overloaded`` (with ``retry_after``) -> 503;
    ``ConnectionTimeout``, ``ResponseTimeout`` -> 504; ``Cancelled`` -> 499; ``NotFound`` (a
    worker does not hold the request's LoRA adapter: unloaded meanwhile) -> 404; others -> 500.
    """
    message = exc.message or str(exc) or exc.kind
    code = _snake(exc.kind)
    if isinstance(exc, errors.InvalidArgument):
        return HttpError(400, INVALID_REQUEST, message, code=code)
    if isinstance(exc, errors.Overloaded):
        err = no_worker(message)
        err.retry_after = max(1, math.ceil(exc.retry_after))
    elif isinstance(exc, (errors.CannotConnect, errors.EngineShutdown, errors.Disconnected)):
        err = no_worker(message)
    elif isinstance(exc, (errors.ConnectionTimeout, errors.ResponseTimeout)):
        err = timeout(message)
    elif isinstance(exc, errors.Cancelled):
        err = client_closed(message)
    elif isinstance(exc, errors.NotFound):
        err = HttpError(404, INVALID_REQUEST, message, param="model")
    else:
        err = engine_error(message)
    err.code = code
    return err


def from_exception(exc: BaseException) -> HttpError:
    """Any exception as an ``HttpError``: itself, ``from_dynamo`` for Dynamo errors, else 500."""
    if isinstance(exc, HttpError):
        return exc
    if isinstance(exc, errors.DynamoError):
        return from_dynamo(exc)
    return engine_error(f"{type(exc).__name__}: {exc}")
