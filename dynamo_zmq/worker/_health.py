"""The worker's health: a canary request on the engine (by default one token, or for an engine
that only embeds the embedding of one token; the worker's ``--health-check-payload``), and the
engine's live numbers copied into the metrics. Each change of the verdict goes to
``on_change``: the worker withdraws its generate endpoint from routing while it fails.

The canary runs at start, after idle spells, every ``interval`` while requests are in flight
(a stuck engine with nothing but queued requests), and at once when the engine stalls: a
request has had outputs, and for ``STALL_AFTER`` no output came from the engine for any
request. A healthy engine's outputs come milliseconds apart while it decodes, so a canary sent
on a stall that has no answer after ``STALL_CANARY_TIMEOUT``, in a process not short of CPU
itself (its watch has been on time), means the engine stopped producing (a stuck kernel, a
deadlock; the process and its loop live on, so liveness sees nothing): the worker leaves
routing 0.35-0.8 s after the engine's last output, and the canary's answer, whenever it comes,
brings it back. A canary that passes counts as the engine's progress, so readers that stopped
taking outputs (slow clients) cost one canary per stall, no withdrawal. Otherwise a canary
fails when it has no answer after ``CANARY_TIMEOUT``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from ..context import Context
from ..llm import (
    EmbeddingOptions,
    FinishReason,
    LLMEngine,
    LLMEngineOutput,
    PreprocessedRequest,
    StopConditions,
)
from ..resources import cancel_and_wait
from ._metrics import WorkerMetrics

__all__ = [
    "CANARY_TIMEOUT",
    "STALL_AFTER",
    "STALL_CANARY_TIMEOUT",
    "Health",
    "default_payload",
    "embedding_payload",
]

log = logging.getLogger("dynamo_zmq.worker")

#: Seconds the canary may take before it counts as failed.
CANARY_TIMEOUT = 30.0
#: Seconds without any output from the engine, while a request that has had outputs is in
#: flight, after which a canary goes out at once.
STALL_AFTER = 0.25
#: Seconds a canary sent on a stall may go unanswered before the worker leaves routing.
STALL_CANARY_TIMEOUT = 0.35
#: Seconds between two looks at the engine's progress.
WATCH_TICK = 0.1
#: A look this much late means this process is short of CPU: no stall is judged until it has
#: been punctual for a stall's whole window (its outputs were slowed with it).
LATE = 0.05


class Health:
    """Whether the engine answers, and when it last served a request or produced an output.

    Args:
        engine: the started engine.
        metrics: the worker's metrics (``healthy``, KV gauges).
        interval: run the canary after this many idle seconds, and this often while busy.
        payload: the request the canary sends (default: one token, ``default_payload``).
        on_change: called with each new verdict (and the first), e.g. to leave routing.
    """

    def __init__(
        self,
        engine: LLMEngine,
        metrics: WorkerMetrics,
        interval: float,
        payload: PreprocessedRequest | None = None,
        on_change: Callable[[bool], None] | None = None,
    ) -> None:
        self._engine = engine
        self._metrics = metrics
        self._interval = interval
        self._payload = payload
        self._on_change = on_change
        self._reported: bool | None = None
        self.healthy = False
        self.detail: dict[str, Any] = {"status": "starting"}
        self.inflight = 0
        #: Requests in flight that have had outputs (their engine should be producing).
        self.decoding = 0
        #: When the engine last produced an output (set by ``Accounting``), or a canary passed.
        self.progress = time.monotonic()
        self._last_activity = time.monotonic()
        self._last_canary = time.monotonic()
        self._late_at = 0.0

    def request_started(self) -> None:
        self.inflight += 1

    def request_ended(self, had_outputs: bool = False) -> None:
        self.inflight -= 1
        if had_outputs:
            self.decoding -= 1
        self._last_activity = time.monotonic()

    def stalled_for(self, now: float) -> float:
        """Seconds the engine has produced nothing while a request awaits its outputs (0: it
        is not stalled)."""
        return now - self.progress if self.decoding > 0 else 0.0

    async def canary(self) -> None:
        """Send the canary request to the engine directly; the result sets ``healthy``: it
        passes when the engine ends it with ``length`` or ``stop``."""
        request = default_payload() if self._payload is None else self._payload
        ctx = Context(f"health-{time.monotonic_ns()}")
        started = self._last_canary = time.monotonic()
        detail: dict[str, Any]
        try:
            async with asyncio.timeout(CANARY_TIMEOUT):
                out = await self._last_output(request, ctx)
            ok = out is not None and out.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
            detail = {"status": "healthy" if ok else "unhealthy",
                      "finish_reason": out and out.finish_reason}
        except Exception as exc:
            ok, detail = False, {"status": "unhealthy", "error": f"{type(exc).__name__}: {exc}"}
            await self._abort(ctx)
        now = time.monotonic()
        detail["canary_seconds"] = round(now - started, 4)
        if ok:
            self.progress = max(self.progress, now)
        self._verdict(ok, detail)

    def _verdict(self, ok: bool, detail: dict[str, Any]) -> None:
        if ok != self.healthy:
            log.log(logging.INFO if ok else logging.WARNING, "health canary: %s", detail)
        self.healthy, self.detail = ok, detail
        self._metrics.healthy.set(1 if ok else 0)
        if ok != self._reported:
            self._reported = ok
            if self._on_change is not None:
                self._on_change(ok)

    async def _last_output(
        self, request: PreprocessedRequest, ctx: Context
    ) -> LLMEngineOutput | None:
        if request.embedding is not None:  # an embedding engine's canary
            vector = await self._engine.embed(request, ctx)
            return LLMEngineOutput(finish_reason=FinishReason.STOP, embedding=vector)
        last = None
        stream = self._engine.generate(request, ctx)
        try:
            async for out in stream:
                last = out
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
        return last

    async def _abort(self, ctx: Context) -> None:
        """Free a canary that failed (a stuck engine may not answer: bounded)."""
        ctx.kill()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):
                await self._engine.abort(ctx)

    async def run(self) -> None:
        """Until cancelled: refresh the engine's numbers every second, and send the canary when
        one is due (see the module docstring), one at a time."""
        probe: asyncio.Task[None] | None = None
        stats_at = last = time.monotonic()
        try:
            while True:
                await asyncio.sleep(WATCH_TICK)
                now = time.monotonic()
                late = now - last - WATCH_TICK
                if late > LATE:  # this loop was held up (GC, CPU starvation), outputs with it
                    self._late_at = now
                    if late > STALL_AFTER:
                        self.progress = max(self.progress, now)
                last = now
                if now - stats_at >= 1.0:
                    stats_at = now
                    self.refresh_stats()
                if probe is not None and not probe.done():
                    self._judge_stall(now)
                    continue
                if probe is not None:
                    await probe  # its verdict is given; an unexpected error surfaces here
                    probe = None
                if self._canary_due(now):
                    probe = asyncio.create_task(self.canary(), name="worker-health-canary")
        finally:
            if probe is not None:
                await cancel_and_wait((probe,))

    def _canary_due(self, now: float) -> bool:
        if self.stalled_for(now) > STALL_AFTER:
            return True
        if self.inflight:
            return now - self._last_canary >= self._interval
        return now - max(self._last_activity, self._last_canary) >= self._interval

    def _judge_stall(self, now: float) -> None:
        """A canary is out: if the engine is stalled and the canary has had no answer for
        ``STALL_CANARY_TIMEOUT``, the engine counts as stuck until the canary answers."""
        stalled = self.stalled_for(now)
        waited = now - self._last_canary
        punctual = now - self._late_at > STALL_AFTER + STALL_CANARY_TIMEOUT
        if self.healthy and punctual and stalled > STALL_AFTER and waited > STALL_CANARY_TIMEOUT:
            self._verdict(False, {
                "status": "unhealthy",
                "error": f"the engine produced nothing for {stalled:.2f}s with requests in "
                         f"flight, and its canary has had no answer for {waited:.2f}s",
            })

    def refresh_stats(self) -> None:
        self._metrics.refresh(self._engine.stats())


def default_payload() -> PreprocessedRequest:
    """The canary request unless the worker names another: one token after token id 1."""
    return PreprocessedRequest(token_ids=[1], stop=StopConditions(max_tokens=1, ignore_eos=True))


def embedding_payload() -> PreprocessedRequest:
    """The canary of an engine that only embeds: the embedding of token id 1."""
    return PreprocessedRequest(token_ids=[1], embedding=EmbeddingOptions())
