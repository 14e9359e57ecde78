"""Request migration (Dynamo's ``--migration-limit``): a stream whose worker is lost after it
sent outputs continues on another worker, and the caller sees one uninterrupted stream.

``migrating`` wraps the stream a ``ModelRouter`` returned, so every routing mode gets it. When
the stream fails with a retryable ``DynamoError`` after outputs arrived (the worker died or hung:
``Disconnected``; it shut down: ``EngineShutdown``; frames were lost: ``StreamIncomplete``),
the request is sent again with its prompt extended by the tokens already generated, what is left
of its token budget and a ``Resume`` telling the new worker how many prompt tokens are output
already streamed (its post-processing replays them, see ``PostProcessor``). The instances lost
are excluded. Failures before the first output stay the runtime's failover's (``failover``).

Never migrated: a stopped or killed request (its caller left, its deadline passed), a
non-retryable error, an error terminal (``finish_reason="error"``, which is an output), and a
request ``resumable`` says cannot be resumed (those end with ``EngineShutdown`` saying why).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from .. import errors
from ..context import Context
from ._engine import LLMEngineOutput, PreprocessedRequest, Resume, RoutingHints
from ._routing import ModelRouter, OutputStream

__all__ = ["DEFAULT_MIGRATION_LIMIT", "MIGRATION_WAIT", "MigratingStream", "resumable"]

log = logging.getLogger(__name__)

#: Migrations a request may make by default (``--migration-limit``; 0 turns migration off).
DEFAULT_MIGRATION_LIMIT = 3
#: Seconds a migration waits for an instance it may go to (one restarting on the same port, or
#: one not discovered yet) when none is live.
MIGRATION_WAIT = 5.0

_MAX_BATCH = 256


def resumable(request: PreprocessedRequest) -> str | None:
    """Why ``request`` cannot continue on another worker from its generated tokens (None: it
    can). The one place that says so; docs/operations.md lists the reasons.

    - presence or frequency penalties count the generated tokens, which a resumed request's
      engine would see as prompt (repetition penalty covers prompt and output alike: fine);
    - ``n`` > 1: several sequences share the stream;
    - native processing (``output.detokenize``): the engine makes the text, and what it held
      back (a partial character) cannot be replayed on another worker.
    """
    sampling = request.sampling
    if sampling.presence_penalty or sampling.frequency_penalty:
        return ("presence/frequency penalties count generated tokens, which another worker "
                "would see as prompt")
    if sampling.n > 1:
        return f"it asks for n={sampling.n} sequences"
    if request.output.detokenize:
        return "its engine makes the text itself (native processing)"
    return None


class MigratingStream:
    """An ``OutputStream`` that moves its request to another worker when the one serving it
    is lost mid-stream (see the module docstring). It keeps a reference to each batch of
    outputs it hands out and looks into them only when it migrates.

    Args:
        stream: the first attempt's stream (what the router returned).
        router: the model's router, to send the continuation.
        request: the request as the caller made it (never modified).
        limit: migrations allowed (the first stream's failure is the first migration).
        idle_timeout: as given to the router.
        deadline: the loop time the request's deadline passes at (None: no deadline); a
            continuation gets what is left of it as its timeout.
        on_migrate: called with the error kind of each migration (metrics).
    """

    def __init__(
        self,
        stream: OutputStream,
        router: ModelRouter,
        request: PreprocessedRequest,
        limit: int,
        idle_timeout: float | None = None,
        deadline: float | None = None,
        on_migrate: Callable[[str], object] | None = None,
    ) -> None:
        self._stream = stream
        self._router = router
        self._request = request
        self._limit = limit
        self._idle_timeout = idle_timeout
        self._deadline = deadline
        self._on_migrate = on_migrate
        #: Every batch handed out, by reference (flattened only to migrate).
        self._batches: list[list[LLMEngineOutput]] = []
        self._pending: list[LLMEngineOutput] = []
        self._lost: set[int] = set()
        #: Migrations made so far.
        self.migrations = 0

    @property
    def context(self) -> Context:
        return self._stream.context

    @property
    def instance_id(self) -> int:
        return self._stream.instance_id

    def __aiter__(self) -> AsyncIterator[LLMEngineOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[LLMEngineOutput]:
        while True:
            batch = await self.next_batch()
            if not batch:
                return
            for out in batch:
                yield out

    async def __anext__(self) -> LLMEngineOutput:
        if not self._pending:
            self._pending = (await self.next_batch())[::-1]
            if not self._pending:
                raise StopAsyncIteration
        return self._pending.pop()

    async def next_batch(self, max_items: int = _MAX_BATCH) -> list[LLMEngineOutput]:
        """Every output that has arrived (at least one; ``[]`` at the end), across workers."""
        while True:
            try:
                batch = await self._stream.next_batch(max_items)
            except errors.DynamoError as exc:
                await self._migrate(exc)
                continue
            if batch:
                self._batches.append(batch)
            return batch

    async def aclose(self) -> None:
        await self._stream.aclose()

    # -- migrating -------------------------------------------------------------------------

    async def _migrate(self, exc: errors.DynamoError) -> None:
        """Continue on another worker, or raise (``exc``, or why the request cannot go on)."""
        ctx = self.context
        if (
            not exc.retryable
            or not self._batches
            or ctx.is_stopped()
            or self.migrations >= self._limit
        ):
            raise exc
        if self._batches[-1] and self._batches[-1][-1].finish_reason is not None:
            raise exc  # its terminal was delivered: nothing to continue
        generated = [t for batch in self._batches for out in batch for t in out.token_ids]
        g = len(generated)
        lost = self._stream.instance_id
        why = (f"the worker serving it ({lost:x}) was lost after {g} tokens "
               f"({exc.kind}: {exc.message})")
        if (reason := resumable(self._request)) is not None:
            raise errors.EngineShutdown(f"{why}; it cannot be resumed elsewhere: {reason}") from exc
        request = self._continuation(generated)
        if request is None:
            raise errors.EngineShutdown(
                f"{why}; its token budget is spent but its end was lost"
            ) from exc
        self._lost.add(lost)
        self.migrations += 1
        log.info("request %s: %s; migrating (%d of at most %d)", ctx.id(), why,
                 self.migrations, self._limit)
        stream = await self._reopen(request, exc)
        self._stream = stream
        if self._on_migrate is not None:
            self._on_migrate(exc.kind)

    def _continuation(self, generated: list[int]) -> PreprocessedRequest | None:
        """The request to send now: the original's prompt and the tokens generated, with what
        is left of its budget (None: nothing is left)."""
        original = self._request
        g = len(generated)
        stop = original.stop
        max_tokens = stop.max_tokens
        if max_tokens is not None:
            max_tokens -= g
            if max_tokens < 1:
                return None
        return msgspec.structs.replace(
            original,
            token_ids=[*original.token_ids, *generated],
            stop=msgspec.structs.replace(
                stop, max_tokens=max_tokens, min_tokens=max(0, stop.min_tokens - g)
            ),
            routing=RoutingHints(),
            resume=Resume(generated=g, min_tokens=stop.min_tokens),
        )

    async def _reopen(
        self, request: PreprocessedRequest, exc: errors.DynamoError
    ) -> OutputStream:
        """Send the continuation, waiting up to ``MIGRATION_WAIT`` for an instance not lost."""
        loop = asyncio.get_running_loop()
        wait_until = loop.time() + MIGRATION_WAIT
        ctx = self.context
        exclude = frozenset(self._lost)
        while True:
            extra: dict[str, Any] = {"exclude": exclude}
            if self._deadline is not None:
                left = self._deadline - loop.time()
                if left <= 0:
                    raise exc
                extra["timeout"] = left
            try:
                return await self._router.generate(
                    request, ctx, idle_timeout=self._idle_timeout, **extra
                )
            except errors.CannotConnect:
                if ctx.is_stopped() or loop.time() >= wait_until:
                    raise exc from None
            await asyncio.sleep(0.1)  # a migration only: a bounded poll for a new instance
