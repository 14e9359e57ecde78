"""Typed errors shared by every layer, and their wire form.

Every error that can cross a process boundary is a ``DynamoError`` with a stable ``kind`` string.
The wire carries ``(kind, message)``; ``from_wire`` rebuilds the same class on the other side.

    DynamoError                      base; ``kind`` names it on the wire
    ├── InvalidArgument              the request itself is wrong (not retryable)
    ├── CannotConnect                no live instance could be reached (retryable)
    ├── Disconnected                 the peer vanished mid-stream (retryable / migratable)
    │   └── StreamStalled            the stream brought nothing for its stall timeout (same)
    ├── ConnectionTimeout            connecting or discovering took too long (retryable)
    ├── ResponseTimeout              the peer stopped answering within the deadline
    ├── Cancelled                    the caller stopped or killed the request
    ├── EngineShutdown               the worker is draining and admits nothing new (retryable)
    ├── Overloaded                   every worker is busy and the wait queue is full or timed out
    ├── StreamIncomplete             a stream ended without its terminal or with a sequence gap
    ├── Unsupported                  the engine or endpoint does not offer the operation
    ├── PermissionDenied             the caller's key lacks a role the endpoint admits (auth on)
    └── Unknown                      anything else, including a handler's unexpected exception
"""

from __future__ import annotations

__all__ = [
    "Cancelled",
    "CannotConnect",
    "ConnectionTimeout",
    "Disconnected",
    "DynamoError",
    "EngineShutdown",
    "InvalidArgument",
    "NotFound",
    "Overloaded",
    "PermissionDenied",
    "ResponseTimeout",
    "StreamIncomplete",
    "StreamStalled",
    "Unknown",
    "Unsupported",
    "from_exception",
    "from_wire",
]


class DynamoError(Exception):
    """Base of all typed errors. ``kind`` is the stable wire name."""

    kind: str = "Unknown"
    #: Whether sending the same request to another instance may succeed.
    retryable: bool = False

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


class InvalidArgument(DynamoError):
    """The request is malformed or names something that does not exist."""

    kind = "InvalidArgument"


class CannotConnect(DynamoError):
    """No live instance serves the endpoint, or the one named is unreachable."""

    kind = "CannotConnect"
    retryable = True


class Disconnected(DynamoError):
    """The peer went away while a stream was open."""

    kind = "Disconnected"
    retryable = True


class StreamStalled(Disconnected):
    """The stream brought nothing for its stall timeout while its reader waited (a stuck
    engine, a worker that stopped serving it): lost as if its peer had vanished, so it is
    retried or migrated elsewhere (the caller sends KILL for it)."""

    kind = "StreamStalled"


class ConnectionTimeout(DynamoError):
    """Waiting for an instance or a connection exceeded its deadline."""

    kind = "ConnectionTimeout"
    retryable = True


class ResponseTimeout(DynamoError):
    """The peer did not send the next response within the deadline."""

    kind = "ResponseTimeout"


class Cancelled(DynamoError):
    """The request was stopped or killed by its caller."""

    kind = "Cancelled"


class EngineShutdown(DynamoError):
    """The serving process is shutting down and admits no new work."""

    kind = "EngineShutdown"
    retryable = True


class Overloaded(DynamoError):
    """Every worker is busy and the request could not wait for one (the router's wait queue is
    full, or the request waited its bound). ``retry_after``: seconds after which a retry may
    succeed (not carried on the wire)."""

    kind = "Overloaded"

    def __init__(self, message: str = "", retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class StreamIncomplete(DynamoError):
    """A stream ended without exactly one terminal, or items were lost or reordered."""

    kind = "StreamIncomplete"
    retryable = True


class Unsupported(DynamoError):
    """The engine (or endpoint) does not offer the operation asked for, e.g. an engine without
    ``clear_kv_blocks``. Not retryable: another instance of the same engine says the same."""

    kind = "Unsupported"


class PermissionDenied(DynamoError):
    """With auth on, the caller's key holds no role the endpoint admits (a ``tool`` key asking
    a worker to generate, say). Not retryable: every instance checks the same keys."""

    kind = "PermissionDenied"


class NotFound(DynamoError):
    """What the request names does not exist there: a LoRA adapter the worker does not hold, or
    one to unload that is not loaded. Not retryable on the same instance."""

    kind = "NotFound"


class Unknown(DynamoError):
    """An error with no more specific kind (for example an exception in a handler)."""

    kind = "Unknown"


_BY_KIND: dict[str, type[DynamoError]] = {
    cls.kind: cls
    for cls in (
        InvalidArgument,
        CannotConnect,
        Disconnected,
        ConnectionTimeout,
        ResponseTimeout,
        Cancelled,
        EngineShutdown,
        Overloaded,
        StreamIncomplete,
        StreamStalled,
        Unsupported,
        PermissionDenied,
        NotFound,
        Unknown,
    )
}


def from_wire(kind: str, message: str) -> DynamoError:
    """Rebuild the typed error a peer sent; unknown kinds become ``Unknown`` keeping the kind."""
    cls = _BY_KIND.get(kind)
    if cls is None:
        return Unknown(f"{kind}: {message}")
    return cls(message)


def from_exception(exc: BaseException) -> DynamoError:
    """Map any exception to the typed error that should cross the wire."""
    if isinstance(exc, DynamoError):
        return exc
    try:
        text = str(exc)
    except Exception:  # an exception whose __str__ fails still gets a terminal
        text = "<unprintable>"
    return Unknown(f"{type(exc).__name__}: {text}")
