"""Engine conformance kit and stream-contract validator (Dynamo's capability conformance, in Python).

``validate_stream`` (from ``dynamo_zmq.stream_contract``, re-exported here) wraps one
``generate`` stream and raises as soon as it breaks the stream contract; the worker wraps engine
streams with it in debug mode, and tests wrap every engine stream with it.
``run_conformance(factory)`` runs the lifecycle checks of ``engine.py`` against
fresh engines from ``factory`` and raises the first failure as a typed error:

    ConformanceError (AssertionError)  base; the message says what the engine did
    ├── StartFailed                    start raised, hung, or did not return an EngineConfig
    ├── EmptyModelName                 start returned an EngineConfig with no model_name
    ├── StreamContractError            a generate stream broke the stream contract
    │   ├── NotAStream                 generate returned something that is not an async iterator
    │   ├── NotAnOutput                the stream yielded something other than LLMEngineOutput
    │   ├── NoTerminal                 the stream ended (or hung) without a terminal chunk
    │   ├── ChunkAfterTerminal         a non-terminal chunk came after the terminal
    │   ├── MultipleTerminals          a second terminal chunk came after the terminal
    │   └── BadFinishReason            a finish_reason outside FinishReason.ALL
    ├── GenerateFailed                 generate raised, or ended with error/cancelled unasked
    ├── ConcurrentGenerateFailed       one of N concurrent generates failed
    ├── CancelIgnored                  stop + abort not answered with "cancelled" within 2 s
    ├── AbortFailed                    abort(ctx) raised or hung
    ├── CleanupFailed                  cleanup after start raised or hung
    ├── CleanupNotIdempotent           a second cleanup raised or hung
    └── CleanupBeforeStartFailed       cleanup on a never-started engine raised or hung

Every engine call is bounded by a timeout, so a hung engine fails its check instead of hanging
the kit. An engine that blocks the event loop (synchronous work without awaiting) cannot be
bounded this way.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec

from .context import Context
from .llm import (
    BadFinishReason,
    ChunkAfterTerminal,
    ConformanceError,
    EngineConfig,
    FinishReason,
    LLMEngine,
    LLMEngineOutput,
    MultipleTerminals,
    NotAnOutput,
    NotAStream,
    NoTerminal,
    PreprocessedRequest,
    StopConditions,
    StreamContractError,
    validate_stream,
)
from .resources import cancel_and_wait

__all__ = [
    "CANCEL_DEADLINE",
    "AbortFailed",
    "BadFinishReason",
    "CancelIgnored",
    "ChunkAfterTerminal",
    "CleanupBeforeStartFailed",
    "CleanupFailed",
    "CleanupNotIdempotent",
    "ConcurrentGenerateFailed",
    "ConformanceError",
    "ConformanceReport",
    "EmptyModelName",
    "GenerateFailed",
    "MultipleTerminals",
    "NoTerminal",
    "NotAStream",
    "NotAnOutput",
    "StartFailed",
    "StreamContractError",
    "default_request",
    "run_conformance",
    "validate_stream",
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


class EmptyModelName(ConformanceError):
    """``start`` returned an ``EngineConfig`` whose ``model_name`` is empty."""


class GenerateFailed(ConformanceError):
    """``generate`` raised, or ended with "error"/"cancelled" when nobody asked it to."""


class ConcurrentGenerateFailed(ConformanceError):
    """One of several concurrent generates failed, hung or broke the stream contract."""


class CancelIgnored(ConformanceError):
    """After ``ctx.stop()`` and ``abort(ctx)`` the stream did not end with "cancelled" in time."""


class AbortFailed(ConformanceError):
    """``abort(ctx)`` raised or hung."""


class CleanupFailed(ConformanceError):
    """``cleanup`` after ``start`` raised or hung."""


class CleanupNotIdempotent(ConformanceError):
    """A second ``cleanup`` raised or hung."""


class CleanupBeforeStartFailed(ConformanceError):
    """``cleanup`` on an engine that was never started raised or hung."""


@dataclass
class ConformanceReport:
    """What ``run_conformance`` checked: the checks passed, in order, and how long each took."""

    passed: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    config: EngineConfig | None = None

    def __str__(self) -> str:
        lines = [f"{name}: ok ({self.seconds[name] * 1000:.0f} ms)" for name in self.passed]
        return "\n".join(lines)


def default_request() -> PreprocessedRequest:
    """The request the kit sends unless given a ``request_factory``: 8 prompt tokens, 8 out."""
    return PreprocessedRequest(
        token_ids=[1, 2, 3, 4, 5, 6, 7, 8], stop=StopConditions(max_tokens=8)
    )


async def _await(aw: Awaitable[T]) -> T:
    return await aw


async def _bounded(
    aw: Awaitable[T], timeout: float, on_timeout: Callable[[], ConformanceError]
) -> T:
    """Await ``aw`` for at most ``timeout`` seconds; on timeout cancel it and raise ``on_timeout()``."""
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
        return NoTerminal(
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


async def _check_start(factory: EngineFactory, timeout: float, report: ConformanceReport) -> None:
    async with _started(factory, timeout) as (_, config):
        if not config.model_name:
            raise EmptyModelName(
                f"start returned EngineConfig with model_name={config.model_name!r}"
            )
        report.config = config


async def _check_stream(
    factory: EngineFactory, request_factory: Callable[[], PreprocessedRequest], timeout: float
) -> None:
    async with _started(factory, timeout) as (engine, _):
        await _collect(engine, request_factory(), Context(), timeout)


async def _check_concurrent(
    factory: EngineFactory,
    request_factory: Callable[[], PreprocessedRequest],
    timeout: float,
    concurrency: int,
) -> None:
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


async def _check_cancel(
    factory: EngineFactory, request_factory: Callable[[], PreprocessedRequest], timeout: float
) -> None:
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
            return NoTerminal(f"the long request produced no chunk within {timeout:g} s")

        async def drain() -> None:
            async for chunk in stream:
                chunks.append(chunk)

        drainer: asyncio.Task[None] | None = None
        try:
            try:
                first = await _bounded(stream.__anext__(), timeout, no_first)
            except StopAsyncIteration:  # pragma: no cover - validate_stream raises NoTerminal first
                raise NoTerminal("the long request ended with no chunk at all") from None
            except ConformanceError:
                raise
            except Exception as exc:
                raise GenerateFailed(
                    f"the long request raised {exc!r} before its first chunk"
                ) from exc
            if first.is_terminal:
                raise CancelIgnored(
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
                raise CancelIgnored(
                    f"the stream was still open {CANCEL_DEADLINE:g} s after ctx.stop() and "
                    f"abort(ctx), with {len(chunks)} chunk(s) since the stop"
                )
            failure = drainer.exception()
            if isinstance(failure, ConformanceError):
                raise failure
            if failure is not None:
                raise CancelIgnored(
                    f"after ctx.stop() the stream raised {failure!r} instead of ending"
                ) from failure
            last = chunks[-1]
            if last.finish_reason != FinishReason.CANCELLED:
                raise CancelIgnored(
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
                    await asyncio.wait_for(stream.aclose(), _GRACE)
            if drainer is not None and drainer.done() and not drainer.cancelled():
                drainer.exception()


async def _check_cleanup_twice(factory: EngineFactory, timeout: float) -> None:
    engine = await _make(factory)
    await _start(engine, timeout)
    await _cleanup(engine, timeout, CleanupFailed, "cleanup after start")
    await _cleanup(engine, timeout, CleanupNotIdempotent, "a second cleanup")


async def _check_cleanup_unstarted(factory: EngineFactory, timeout: float) -> None:
    engine = await _make(factory)
    await _cleanup(engine, timeout, CleanupBeforeStartFailed, "cleanup on a never-started engine")


async def run_conformance(
    factory: EngineFactory,
    *,
    request_factory: Callable[[], PreprocessedRequest] | None = None,
    timeout: float = 30.0,
    concurrency: int = 8,
) -> ConformanceReport:
    """Run the engine lifecycle checks, each on a fresh engine from ``factory``.

    Checks, in order: ``start`` (non-empty ``model_name``), ``stream`` (one terminal, last),
    ``concurrent`` (``concurrency`` generates at once), ``cancel`` (stop + abort answered with
    "cancelled" within ``CANCEL_DEADLINE``), ``cleanup_twice`` and ``cleanup_before_start``.

    Args:
        factory: builds a new, unstarted engine (may be async).
        request_factory: builds the request each generate sends; the cancel check raises its
            ``max_tokens`` to fill ``context_length`` and sets ``ignore_eos``. Default:
            ``default_request``.
        timeout: bound on each engine call and each whole stream, in seconds.
        concurrency: how many generates the concurrency check runs at once.

    Returns:
        The checks passed, with their durations and the ``EngineConfig`` from ``start``.

    Raises:
        ConformanceError: the first check that failed, as its typed subclass.
    """
    make_request = request_factory or default_request
    report = ConformanceReport()
    checks: list[tuple[str, Callable[[], Awaitable[None]]]] = [
        ("start", lambda: _check_start(factory, timeout, report)),
        ("stream", lambda: _check_stream(factory, make_request, timeout)),
        ("concurrent", lambda: _check_concurrent(factory, make_request, timeout, concurrency)),
        ("cancel", lambda: _check_cancel(factory, make_request, timeout)),
        ("cleanup_twice", lambda: _check_cleanup_twice(factory, timeout)),
        ("cleanup_before_start", lambda: _check_cleanup_unstarted(factory, timeout)),
    ]
    for name, check in checks:
        began = time.monotonic()
        await check()
        report.seconds[name] = time.monotonic() - began
        report.passed.append(name)
    return report
