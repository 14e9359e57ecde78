"""The worker's health: a canary request on the engine (by default one token, or for an engine
that only embeds the embedding of one token; the worker's ``--health-check-payload``), run at
start and after idle spells, and the engine's live numbers copied into the metrics. Each change
of the canary's verdict goes to ``on_change``: the worker withdraws its generate endpoint from
routing while the canary fails."""

from __future__ import annotations

import asyncio
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
from ._metrics import WorkerMetrics

__all__ = ["CANARY_TIMEOUT", "Health", "default_payload", "embedding_payload"]

log = logging.getLogger("dynamo_zmq.worker")

#: Seconds the canary may take before it counts as failed.
CANARY_TIMEOUT = 30.0


class Health:
    """Whether the engine answers, and when it last served a request.

    Args:
        engine: the started engine.
        metrics: the worker's metrics (``healthy``, KV gauges).
        interval: run the canary after this many idle seconds.
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
        self._last_activity = time.monotonic()

    def request_started(self) -> None:
        self.inflight += 1

    def request_ended(self) -> None:
        self.inflight -= 1
        self._last_activity = time.monotonic()

    async def canary(self) -> None:
        """Send the canary request to the engine directly; the result sets ``healthy``: it
        passes when the engine ends it with ``length`` or ``stop``."""
        request = default_payload() if self._payload is None else self._payload
        ctx = Context(f"health-{time.monotonic_ns()}")
        started = time.monotonic()
        detail: dict[str, Any]
        try:
            async with asyncio.timeout(CANARY_TIMEOUT):
                out = await self._last_output(request, ctx)
            ok = out is not None and out.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
            detail = {"status": "healthy" if ok else "unhealthy",
                      "finish_reason": out and out.finish_reason}
        except Exception as exc:
            ok, detail = False, {"status": "unhealthy", "error": f"{type(exc).__name__}: {exc}"}
        detail["canary_seconds"] = round(time.monotonic() - started, 4)
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
        async for out in self._engine.generate(request, ctx):
            last = out
        return last

    async def run(self) -> None:
        """Every second: refresh the engine's numbers; after ``interval`` idle, the canary."""
        while True:
            await asyncio.sleep(min(1.0, self._interval))
            self.refresh_stats()
            idle = time.monotonic() - self._last_activity
            if self.inflight == 0 and idle >= self._interval:
                await self.canary()
                self._last_activity = time.monotonic()

    def refresh_stats(self) -> None:
        self._metrics.refresh(self._engine.stats())


def default_payload() -> PreprocessedRequest:
    """The canary request unless the worker names another: one token after token id 1."""
    return PreprocessedRequest(token_ids=[1], stop=StopConditions(max_tokens=1, ignore_eos=True))


def embedding_payload() -> PreprocessedRequest:
    """The canary of an engine that only embeds: the embedding of token id 1."""
    return PreprocessedRequest(token_ids=[1], embedding=EmbeddingOptions())
