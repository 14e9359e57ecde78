"""How a user's handler becomes what the transport runs: ``(request)`` or ``(request,
context)``, an async generator or a coroutine, with the request decoded (into a typed
``request_type`` when one is given)."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from .. import errors
from ..context import Context
from ..transport import Handler as TransportHandler
from ..wire import decode_item

__all__ = ["adapt_handler"]


def adapt_handler(
    handler: Callable[..., Any], request_type: type | None = None
) -> TransportHandler:
    """Wrap a user handler ``(request)`` or ``(request, context)`` for the transport."""
    wants_context = _accepts_context(handler)
    decode = decode_item if request_type is None else msgspec.msgpack.Decoder(request_type).decode

    def run(payload: msgspec.Raw, ctx: Context) -> AsyncIterator[Any]:
        # A plain function, so the handler's own async generator is what the server iterates:
        # no extra generator layer per item.
        try:
            request = decode(payload)
        except msgspec.ValidationError as exc:
            raise errors.InvalidArgument(f"invalid request: {exc}") from exc
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise errors.InvalidArgument(f"request is not valid MessagePack: {exc}") from exc
        result = handler(request, ctx) if wants_context else handler(request)
        if hasattr(result, "__aiter__"):
            return result  # type: ignore[no-any-return]  # hasattr() does not narrow Any
        if inspect.isawaitable(result):
            return _single(result)
        raise errors.Unknown(f"handler returned {type(result).__name__}, not an async iterator")

    return run


async def _single(result: Any) -> AsyncIterator[Any]:
    """A handler that is a plain coroutine answers with one response."""
    yield await result


def _accepts_context(handler: Callable[..., Any]) -> bool:
    try:
        params = list(inspect.signature(handler).parameters.values())
    except (TypeError, ValueError):
        return False
    if any(p.name == "context" for p in params):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)
