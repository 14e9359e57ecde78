"""The steps of one generate request on the worker (``Worker._generate``): ``admit`` it, then
(for a generation) give the engine a context of its own (``EngineContext``), assemble the
stream the worker reads (``engine_stream``: the engine's, validated, post-processed, traced) and
account for it (``Accounting``: metrics and health, from admission to the end)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from tokenizers import Tokenizer

from .. import errors
from ..context import Context
from ..llm import (
    LLMEngine,
    LLMEngineOutput,
    ModelCard,
    PostProcessor,
    PreprocessedRequest,
    stop_bounds_error,
    validate_stream,
    with_resumed_usage,
)
from ._engine_span import trace_engine
from ._health import Health
from ._metrics import ModelMetrics

__all__ = ["Accounting", "EngineContext", "admit", "engine_stream"]

_monotonic = time.monotonic


def admit(request: PreprocessedRequest, card: ModelCard) -> None:
    """Refuse what this worker cannot serve as asked.

    Raises:
        InvalidArgument: preprocessed for another model card, a resume past the prompt, or
            stop strings beyond the bounds (a frontend answers 400 before it gets here).
    """
    if request.mdcsum and request.mdcsum != card.checksum:
        raise errors.InvalidArgument(
            f"request preprocessed for model card {request.mdcsum}, but this worker serves "
            f"{card.name!r} with card {card.checksum}"
        )
    if request.resume is not None and request.resume.generated > len(request.token_ids):
        raise errors.InvalidArgument(
            f"resume.generated ({request.resume.generated}) exceeds the prompt's "
            f"{len(request.token_ids)} tokens"
        )
    if (stop_error := stop_bounds_error(request.stop.stop)) is not None:
        raise errors.InvalidArgument(f"stop: {stop_error}")


class EngineContext:
    """The engine's own context for one request: a child of the request's (a stop or kill
    reaches it) that a matched stop string can also stop alone. Either way the engine is asked
    once to abort (``engine.abort``, spawned), counted as a cancellation when the client did it.

    Args:
        engine: the engine the request runs on.
        ctx: the request's context.
        spawn: runs the abort coroutine in the background (the worker's resources own it).
        on_cancel: called once when the client stopped or killed the request.
        handing_over: whether a kill now is the worker's hand-over (not a cancellation).
    """

    def __init__(self, engine: LLMEngine, ctx: Context, spawn: Callable[[Any, str], object],
                 on_cancel: Callable[[], None], handing_over: Callable[[], bool]) -> None:
        self.engine = engine
        self.ctx = Context(ctx.id())
        ctx.link_child(self.ctx)
        self._spawn = spawn
        self._on_cancel = on_cancel
        self._aborted = False
        self.close = ctx.add_listener(lambda _killed: self._abort(not handing_over()))

    def stop(self) -> None:
        """A stop string matched: the engine stops (not a cancellation)."""
        self.ctx.stop()
        self._abort(cancelled=False)

    def _abort(self, cancelled: bool) -> None:
        if self._aborted:
            return
        self._aborted = True
        if cancelled:
            self._on_cancel()
        self._spawn(self.engine.abort(self.ctx), f"abort-{self.ctx.id()}")


def engine_stream(
    engine: LLMEngine, request: PreprocessedRequest, engine_ctx: Context, ctx: Context, *,
    tokenizer: Tokenizer | None, tool_parser: str | None, reasoning_parser: str | None,
    debug: bool, role: str,
) -> tuple[AsyncIterator[LLMEngineOutput], PostProcessor | None, str | None]:
    """The engine's stream for ``request`` as the worker reads it: validated with ``debug``,
    with usage corrected for a migrated request the worker does not post-process, under the
    ``engine.generate`` span with tracing on. Also the post-processor the worker applies chunk
    by chunk (None: chunks pass as the engine made them) and the span's ``traceparent``."""
    stream = engine.generate(request, engine_ctx)
    if debug:
        stream = validate_stream(stream)
    # Post-processing runs in the worker's loop, chunk by chunk, rather than as one more
    # generator layer around the engine's (``llm.postprocess`` is the same loop, on its own).
    proc = (
        PostProcessor(request, tokenizer, tool_parser, reasoning_parser,
                      request.request_id or ctx.id())
        if tokenizer is not None or request.output.detokenize
        else None
    )
    if proc is None and request.resume is not None:  # a migrated request: usage as its own
        stream = with_resumed_usage(stream, request.resume.generated)
    stream, link = trace_engine(  # (stream, None) with tracing off: nothing per chunk
        stream, request, ctx, role, proc is not None)
    return stream, proc, link


class Accounting:
    """One request's metrics and health, from its admission (``__init__``) to its end
    (``end``, once): requests, in-flight, TTFT and inter-token latency, output tokens,
    duration, and the health canary's idea of when the worker last served and when the engine
    last produced an output."""

    __slots__ = ("_health", "_itl", "_last", "_metrics", "_start", "tokens")

    def __init__(self, metrics: ModelMetrics, health: Health) -> None:
        self._metrics, self._health = metrics, health
        self._itl = metrics.itl.observe
        metrics.requests.inc()
        metrics.inflight.inc()
        health.request_started()
        self._start = self._last = _monotonic()
        self.tokens = 0

    def output(self, out: LLMEngineOutput, link: str | None) -> None:
        """An output with tokens went out (the first carries the engine span's ``link``)."""
        now = _monotonic()
        if self.tokens:  # every output but the first: once per token
            self._itl(now - self._last)
        else:
            self._metrics.ttft.observe(now - self._start)
            out.worker_trace_link = link
            self._health.decoding += 1
        self.tokens += len(out.token_ids)
        self._last = self._health.progress = now

    def end(self) -> None:
        m = self._metrics
        m.output_tokens.inc(self.tokens)
        m.duration.observe(_monotonic() - self._start)
        m.inflight.dec()
        self._health.request_ended(self.tokens > 0)
