"""Engine conformance kit and stream-contract validator (Dynamo's ``dynamo_backend_common::
testing``, as the backend-common document describes it).

``validate_stream`` (from ``dynamo_zmq.llm``, re-exported here) wraps one ``generate`` stream
and raises as soon as it breaks the stream contract; the worker wraps engine streams with it in
debug mode, and tests wrap every engine stream with it. ``run_conformance(factory)`` runs the
lifecycle checks of ``engine.py`` against fresh engines from ``factory`` and raises the first
failure as a typed error. The document's eight failures keep its names (marked *); the others
say more precisely what went wrong around them:

    ConformanceError (AssertionError)  base; the message says what the engine did
    ├── EmptyModelInConfig *           start returned an EngineConfig with no model_name
    ├── StartFailed                    start raised, hung, or did not return an EngineConfig
    ├── StreamContractError            a generate stream broke the stream contract
    │   ├── NoTerminalChunk *          the stream ended (or hung) without a terminal
    │   ├── ChunkAfterTerminal *       something came after the terminal
    │   │   └── MultipleTerminals      ... a second terminal chunk, or a typed error
    │   ├── NotAStream                 generate returned something that is not an async iterator
    │   ├── NotAnOutput                the stream yielded something other than LLMEngineOutput
    │   └── BadFinishReason            a finish_reason outside FinishReason.ALL
    ├── GenerateFailed                 generate raised, or ended with error/cancelled unasked
    ├── ConcurrentGenerateFailed *     one of N concurrent generates failed
    ├── CancellationNotObserved *      the stopped stream was still open after 2 s
    ├── CancellationIgnored *          the stopped stream ended, but not with "cancelled"
    ├── AbortFailed                    abort(ctx) raised or hung
    ├── CleanupFailed                  cleanup after start raised or hung
    ├── SecondCleanupFailed *          a second cleanup raised or hung
    └── CleanupWithoutStartFailed *    cleanup on a never-started engine raised or hung

``mock_context()`` and ``cancelling_context(after)`` are the document's helpers for
hand-written engine tests.

Every engine call is bounded by a timeout, so a hung engine fails its check instead of hanging
the kit. An engine that blocks the event loop (synchronous work without awaiting) cannot be
bounded this way. This module owns the runner and its report; the checks and their errors live
in ``_conformance_checks.py``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from ._conformance_checks import CANCEL_DEADLINE as CANCEL_DEADLINE
from ._conformance_checks import AbortFailed as AbortFailed
from ._conformance_checks import CancellationIgnored as CancellationIgnored
from ._conformance_checks import CancellationNotObserved as CancellationNotObserved
from ._conformance_checks import CleanupFailed as CleanupFailed
from ._conformance_checks import CleanupWithoutStartFailed as CleanupWithoutStartFailed
from ._conformance_checks import ConcurrentGenerateFailed as ConcurrentGenerateFailed
from ._conformance_checks import EmptyModelInConfig as EmptyModelInConfig
from ._conformance_checks import (
    EngineFactory,
    check_cancel,
    check_cleanup_twice,
    check_cleanup_unstarted,
    check_concurrent,
    check_start,
    check_stream,
)
from ._conformance_checks import GenerateFailed as GenerateFailed
from ._conformance_checks import SecondCleanupFailed as SecondCleanupFailed
from ._conformance_checks import StartFailed as StartFailed
from .context import Context
from .llm import BadFinishReason as BadFinishReason
from .llm import ChunkAfterTerminal as ChunkAfterTerminal
from .llm import ConformanceError as ConformanceError
from .llm import EngineConfig, PreprocessedRequest, StopConditions
from .llm import MultipleTerminals as MultipleTerminals
from .llm import NotAnOutput as NotAnOutput
from .llm import NotAStream as NotAStream
from .llm import NoTerminalChunk as NoTerminalChunk
from .llm import StreamContractError as StreamContractError
from .llm import validate_stream as validate_stream

__all__ = [
    "CANCEL_DEADLINE",
    "AbortFailed",
    "BadFinishReason",
    "CancellationIgnored",
    "CancellationNotObserved",
    "ChunkAfterTerminal",
    "CleanupFailed",
    "CleanupWithoutStartFailed",
    "ConcurrentGenerateFailed",
    "ConformanceError",
    "ConformanceReport",
    "EmptyModelInConfig",
    "GenerateFailed",
    "MultipleTerminals",
    "NoTerminalChunk",
    "NotAStream",
    "NotAnOutput",
    "SecondCleanupFailed",
    "StartFailed",
    "StreamContractError",
    "cancelling_context",
    "default_request",
    "mock_context",
    "run_conformance",
    "validate_stream",
]


@dataclass
class ConformanceReport:
    """What ``run_conformance`` checked: the checks passed, in order, and how long each took."""

    passed: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    config: EngineConfig | None = None

    def __str__(self) -> str:
        lines = [f"{name}: ok ({self.seconds[name] * 1000:.0f} ms)" for name in self.passed]
        return "\n".join(lines)


def mock_context(request_id: str | None = None) -> Context:
    """A fresh, live context for calling ``engine.generate`` by hand (the document's
    ``mock_context()``): linked to nothing, stopped only when the test says so."""
    return Context(request_id)


def cancelling_context(after: float, request_id: str | None = None) -> Context:
    """A context that stops itself ``after`` seconds from now (the document's
    ``cancelling_context(after)``): the engine under test should end its stream with a
    "cancelled" terminal soon after. Call it inside the running event loop that reads the
    stream.

    Raises:
        RuntimeError: no event loop is running.
        ValueError: ``after`` is negative or not finite.
    """
    if not math.isfinite(after) or after < 0:
        raise ValueError(f"after must be a finite number >= 0, got {after!r}")
    ctx = Context(request_id)
    asyncio.get_running_loop().call_later(after, ctx.stop_generating)
    return ctx


def default_request() -> PreprocessedRequest:
    """The request the kit sends unless given a ``request_factory``: 8 prompt tokens, 8 out."""
    return PreprocessedRequest(
        token_ids=[1, 2, 3, 4, 5, 6, 7, 8], stop=StopConditions(max_tokens=8)
    )


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
        ConformanceError: the first check that failed, as its typed subclass; its ``check``
            names that check.
    """
    make_request = request_factory or default_request
    report = ConformanceReport()

    async def start() -> None:
        report.config = await check_start(factory, timeout)

    checks: list[tuple[str, Callable[[], Awaitable[None]]]] = [
        ("start", start),
        ("stream", lambda: check_stream(factory, make_request, timeout)),
        ("concurrent", lambda: check_concurrent(factory, make_request, timeout, concurrency)),
        ("cancel", lambda: check_cancel(factory, make_request, timeout)),
        ("cleanup_twice", lambda: check_cleanup_twice(factory, timeout)),
        ("cleanup_before_start", lambda: check_cleanup_unstarted(factory, timeout)),
    ]
    for name, check in checks:
        began = time.monotonic()
        try:
            await check()
        except ConformanceError as exc:
            exc.check = name
            raise
        report.seconds[name] = time.monotonic() - began
        report.passed.append(name)
    return report
