"""The conformance checks: each runs one lifecycle check of ``engine.py`` on a fresh engine.

``check_start``, ``check_stream``, ``check_concurrent``, ``check_cancel``, ``check_cleanup_twice``
and ``check_cleanup_unstarted`` each raise their typed ``ConformanceError`` (the kit's failures,
defined here under the backend-common document's names; ``dynamo_zmq.testing`` draws the tree)
on the first thing the engine gets wrong.
Every engine call goes through ``_bounded``: a hung call fails its check after ``timeout`` and
is cancelled, and an engine that swallows cancellation is abandoned after a grace period.
``dynamo_zmq.testing.run_conformance`` runs them in order and reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeVar

import msgspec

from .context import Context
from .llm import (
    ConformanceError,
    EngineConfig,
    FinishReason,
    LLMEngine,
    LLMEngineOutput,
    NoTerminalChunk,
    PreprocessedRequest,
    validate_stream,
)
from .resources import cancel_and_wait

__all__ = [
    "CANCEL_DEADLINE",
    "AbortFailed",
    "CancellationIgnored",
    "CancellationNotObserved",
    "CleanupFailed",
    "CleanupWithoutStartFailed",
    "ConcurrentGenerateFailed",
    "EmptyModelInConfig",
    "EngineFactory",
    "GenerateFailed",
    "SecondCleanupFailed",
    "StartFailed",
    "check_cancel",
    "check_cleanup_twice",
    "check_cleanup_unstarted",
    "check_concurrent",
    "check_start",
    "check_stream",
]

#: Seconds an engine has, after ``ctx.stop()`` and ``abort(ctx)``, to end with "cancelled".
CANCEL_DEADLINE = 2.0
#: Seconds a timed-out engine call gets to unwind after it is cancelled.
_GRACE = 1.0
_WORKER_ID = 1
#: ``max_tokens`` of the long request the cancel check stops, when the engine reports no
#: ``context_length`` (otherwise the request fills the context).
_LONG_MAX_TOKENS = 1_000_000

T = TypeVar("T")
EngineFactory = Callable[[], "LLMEngine | Awaitable[LLMEngine]"]


class StartFailed(ConformanceError):
    """``start`` raised, hung, or returned something other than an ``EngineConfig``."""


class EmptyModelInConfig(ConformanceError):
    """``start`` returned an ``EngineConfig`` whose ``model_name`` is empty."""


class GenerateFailed(ConformanceError):
    """``generate`` raised, or ended with "error"/"cancelled" when nobody asked it to."""


class ConcurrentGenerateFailed(ConformanceError):
    """One of several concurrent generates failed, hung or broke the stream contract."""


class CancellationNotObserved(ConformanceError):
    """The stream was still open ``CANCEL_DEADLINE`` seconds after ``ctx.stop()`` and
    ``abort(ctx)``: the engine never saw the cancellation."""


class CancellationIgnored(ConformanceError):
    """The stopped stream ended, but its terminal was not "cancelled" (it finished normally,
    failed, or had already finished before it could be cancelled)."""


class AbortFailed(ConformanceError):
    """``abort(ctx)`` raised or hung."""


class CleanupFailed(ConformanceError):
    """``cleanup`` after ``start`` raised or hung."""


class SecondCleanupFailed(ConformanceError):
    """A second ``cleanup`` raised or hung (``cleanup`` is not idempotent)."""


class CleanupWithoutStartFailed(ConformanceError):
    """``cleanup`` on an engine that was never started raised or hung."""


async def _await(aw: Awaitable[T]) -> T:
    return await aw


async def _bounded(
    aw: Awaitable[T], timeout: float, on_timeout: Callable[[], ConformanceError]
) -> T:
    """Await ``aw`` for at most ``timeout`` seconds; on timeout, cancel it and raise
    ``on_timeout()``."""
    task = asyncio.create_task(_await(aw), name="conformance-call")
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if not done:
            raise on_timeout()
        if task.cancelled():
            raise RuntimeError("the call was cancelled from inside the engine")
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            # An engine that swallows cancellation is abandoned after the grace period.
            await asyncio.wait({task}, timeout=_GRACE)
        if task.done() and not task.cancelled():
            task.exception()  # retrieved, so asyncio does not log it again


async def _make(factory: EngineFactory) -> LLMEngine:
    engine = factory()
    if inspect.isawaitable(engine):
        engine = await engine
    return engine


async def _call(aw: Awaitable[T], timeout: float, error: type[ConformanceError], what: str) -> T:
    """Await one engine call, turning a hang or an exception into ``error``."""

    def hung() -> ConformanceError:
        return error(f"{what} did not return within {timeout:g} s")

    try:
        return await _bounded(aw, timeout, hung)
    except ConformanceError:
        raise
    except Exception as exc:
        raise error(f"{what} raised {exc!r}") from exc


async def _start(engine: LLMEngine, timeout: float) -> EngineConfig:
    what = f"start({_WORKER_ID})"
    config = await _call(engine.start(_WORKER_ID), timeout, StartFailed, what)
    if not isinstance(config, EngineConfig):
        raise StartFailed(f"{what} returned {type(config).__name__}, not EngineConfig: {config!r}")
    return config


async def _cleanup(
    engine: LLMEngine, timeout: float, error: type[ConformanceError], what: str
) -> None:
    await _call(engine.cleanup(), timeout, error, what)


@contextlib.asynccontextmanager
async def _started(
    factory: EngineFactory, timeout: float
) -> AsyncGenerator[tuple[LLMEngine, EngineConfig], None]:
    """A fresh, started engine; cleaned up afterwards (a failing cleanup fails a passing check)."""
    engine = await _make(factory)
    try:
        config = await _start(engine, timeout)
    except BaseException:
        with contextlib.suppress(Exception):
            await _cleanup(engine, timeout, CleanupFailed, "cleanup after a failed start")
        raise
    try:
        yield engine, config
    except BaseException:
        with contextlib.suppress(Exception):
            await _cleanup(engine, timeout, CleanupFailed, "cleanup")
        raise
    await _cleanup(engine, timeout, CleanupFailed, "cleanup after start")


async def _collect(
    engine: LLMEngine, request: PreprocessedRequest, ctx: Context, timeout: float
) -> list[LLMEngineOutput]:
    """Read one whole validated stream; the terminal must be "stop" or "length"."""
    chunks: list[LLMEngineOutput] = []

    async def read() -> None:
        async for chunk in validate_stream(engine.generate(request, ctx)):
            chunks.append(chunk)

    def hung() -> ConformanceError:
        return NoTerminalChunk(
            f"no terminal within {timeout:g} s: the stream hung after {len(chunks)} chunk(s)"
        )

    try:
        await _bounded(read(), timeout, hung)
    except ConformanceError:
        raise
    except Exception as exc:
        raise GenerateFailed(f"generate raised {exc!r} after {len(chunks)} chunk(s)") from exc
    last = chunks[-1]
    if last.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
        raise GenerateFailed(
            f"the stream ended with finish_reason={last.finish_reason!r} (error={last.error!r}) "
            f"for a plain request; expected 'stop' or 'length'"
        )
    return chunks


async def check_start(factory: EngineFactory, timeout: float) -> EngineConfig:
    """``start`` returns an ``EngineConfig`` with a ``model_name``; returns that config."""
    async with _started(factory, timeout) as (_, config):
        if not config.model_name:
            raise EmptyModelInConfig(
                f"start returned EngineConfig with model_name={config.model_name!r}"
            )
    return config


async def check_stream(
    factory: EngineFactory, request_factory: Callable[[], PreprocessedRequest], timeout: float
) -> None:
    """One plain request streams to a single terminal chunk, "stop" or "length"."""
    async with _started(factory, timeout) as (engine, _):
        await _collect(engine, request_factory(), Context(), timeout)


async def check_concurrent(
    factory: EngineFactory,
    request_factory: Callable[[], PreprocessedRequest],
    timeout: float,
    concurrency: int,
) -> None:
    """``concurrency`` generates at once on one engine all complete."""
    async with _started(factory, timeout) as (engine, _):
        requests = [
            msgspec.structs.replace(request_factory(), request_id=f"conformance-{i}")
            for i in range(concurrency)
        ]
        tasks = [
            asyncio.create_task(
                _collect(engine, req, Context(req.request_id), timeout), name=req.request_id
            )
            for req in requests
        ]
        try:
            await asyncio.wait(tasks)
        finally:
            await cancel_and_wait(tasks)
        failed = [(i, t) for i, t in enumerate(tasks) if t.cancelled() or t.exception()]
        if failed:
            i, task = failed[0]
            exc = None if task.cancelled() else task.exception()
            raise ConcurrentGenerateFailed(
                f"{len(failed)} of {concurrency} concurrent generates failed; request {i}: "
                f"{type(exc).__name__ if exc else 'cancelled'}: {exc}"
            ) from exc


async def check_cancel(
    factory: EngineFactory, request_factory: Callable[[], PreprocessedRequest], timeout: float
) -> None:
    """A long request, stopped (``ctx.stop()`` + ``abort(ctx)``), ends "cancelled" in time."""
    async with _started(factory, timeout) as (engine, config):
        base = request_factory()
        room = config.context_length - len(base.token_ids)
        long = room if room > 0 else _LONG_MAX_TOKENS
        stop = msgspec.structs.replace(base.stop, max_tokens=long, ignore_eos=True)
        request = msgspec.structs.replace(base, request_id="conformance-cancel", stop=stop)
        ctx = Context(request.request_id)
        try:
            stream = validate_stream(engine.generate(request, ctx))
        except Exception as exc:
            raise GenerateFailed(f"generate raised {exc!r}") from exc
        chunks: list[LLMEngineOutput] = []

        def no_first() -> ConformanceError:
            return NoTerminalChunk(f"the long request produced no chunk within {timeout:g} s")

        async def drain() -> None:
            async for chunk in stream:
                chunks.append(chunk)

        drainer: asyncio.Task[None] | None = None
        try:
            try:
                first = await _bounded(stream.__anext__(), timeout, no_first)
            except StopAsyncIteration:  # pragma: no cover - validate_stream raises first
                raise NoTerminalChunk("the long request ended with no chunk at all") from None
            except ConformanceError:
                raise
            except Exception as exc:
                raise GenerateFailed(
                    f"the long request raised {exc!r} before its first chunk"
                ) from exc
            if first.is_terminal:
                raise CancellationIgnored(
                    f"the long request (max_tokens={long}, ignore_eos) ended at its first chunk "
                    f"with finish_reason={first.finish_reason!r} (error={first.error!r}); "
                    "nothing was left to cancel"
                )
            ctx.stop()
            stopped_at = time.monotonic()
            drainer = asyncio.create_task(drain(), name="conformance-cancel-drain")

            await _call(engine.abort(ctx), min(timeout, CANCEL_DEADLINE), AbortFailed, "abort(ctx)")
            left = max(0.0, stopped_at + CANCEL_DEADLINE - time.monotonic())
            done, _ = await asyncio.wait({drainer}, timeout=left)
            if not done:
                raise CancellationNotObserved(
                    f"the stream was still open {CANCEL_DEADLINE:g} s after ctx.stop() and "
                    f"abort(ctx), with {len(chunks)} chunk(s) since the stop"
                )
            failure = drainer.exception()
            if isinstance(failure, ConformanceError):
                raise failure
            if failure is not None:
                raise CancellationIgnored(
                    f"after ctx.stop() the stream raised {failure!r} instead of ending"
                ) from failure
            last = chunks[-1]
            if last.finish_reason != FinishReason.CANCELLED:
                raise CancellationIgnored(
                    f"after ctx.stop() and abort(ctx) the stream ended with "
                    f"finish_reason={last.finish_reason!r} after {len(chunks)} more chunk(s); "
                    f"expected 'cancelled'"
                )
        finally:
            if drainer is not None and not drainer.done():
                drainer.cancel()
                await asyncio.wait({drainer}, timeout=_GRACE)
            if drainer is None or drainer.done():
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(_GRACE):
                        await stream.aclose()
            if drainer is not None and drainer.done() and not drainer.cancelled():
                drainer.exception()


async def check_cleanup_twice(factory: EngineFactory, timeout: float) -> None:
    """A second ``cleanup`` after start and cleanup succeeds."""
    engine = await _make(factory)
    await _start(engine, timeout)
    await _cleanup(engine, timeout, CleanupFailed, "cleanup after start")
    await _cleanup(engine, timeout, SecondCleanupFailed, "a second cleanup")


async def check_cleanup_unstarted(factory: EngineFactory, timeout: float) -> None:
    """``cleanup`` on a never-started engine succeeds."""
    engine = await _make(factory)
    await _cleanup(engine, timeout, CleanupWithoutStartFailed, "cleanup on a never-started engine")
