"""Dynamo's decorators: ``@dynamo_worker()`` runs a function with a fresh runtime, and
``@dynamo_endpoint(Req, Resp)`` validates requests before a handler sees them."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from .. import errors
from ..context import Context
from ._runtime import DistributedRuntime

__all__ = ["dynamo_endpoint", "dynamo_worker"]


def dynamo_worker(*_args: Any, **_kwargs: Any) -> Callable[..., Any]:
    """Run the decorated ``async def worker(runtime, ...)`` with a fresh runtime.

    SIGINT/SIGTERM shut the runtime down (``serve_endpoint`` returns after draining); the
    runtime is closed when the function returns.
    """

    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            loop = asyncio.get_running_loop()
            runtime = DistributedRuntime(loop)
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, runtime.shutdown)
            try:
                return await func(runtime, *args, **kwargs)
            finally:
                await runtime.close()

        return wrapper

    return decorator


def dynamo_endpoint(request_model: Any, response_model: Any) -> Callable[..., Any]:
    """Validate requests into ``request_model`` (pydantic or msgspec) before the handler runs."""

    def parse(value: Any) -> Any:
        if isinstance(value, request_model):
            return value
        try:
            if hasattr(request_model, "model_validate"):  # pydantic v2
                return request_model.model_validate(value)
            if isinstance(request_model, type) and issubclass(request_model, msgspec.Struct):
                return msgspec.convert(value, request_model)
        except Exception as exc:
            raise errors.InvalidArgument(f"invalid request: {exc}") from exc
        return value

    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        async def wrapper(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            args_list = list(args)
            # (request), (self, request), (request, context) or (self, request, context)
            with_self = len(args_list) == 3 or (
                len(args_list) == 2 and not isinstance(args_list[1], Context)
            )
            index = 1 if with_self else 0
            args_list[index] = parse(args_list[index])
            async for item in func(*args_list, **kwargs):
                yield item

        return wrapper

    return decorator
