"""Request migration (Dynamo's ``--migration-limit``): a stream whose worker is lost after it
sent outputs continues on another worker, and the caller sees one uninterrupted stream.

``Migration`` sits between the frontend's output loop and the stream a ``ModelRouter`` returned,
so every routing mode gets it: the loop adds each output's token ids to it, and when the stream
fails with a retryable ``DynamoError`` after outputs arrived (the worker died or hung:
``Disconnected``; it shut down: ``EngineShutdown``; frames were lost: ``StreamIncomplete``),
the request is sent again with its prompt extended by the tokens already generated, what is left
of its token budget and a ``Resume`` telling the new worker how many prompt tokens are output
already streamed (its post-processing replays them, see ``PostProcessor``). The instances lost
are excluded. A failure before the first output is the runtime's failover's (``failover``)
first; when it gives up (no other instance then), the request is sent again unchanged, the same
way (waiting for an instance, counted against the limit).

A stream that brings nothing for the stall timeout (``--stream-stall-timeout``) while a
migration could still move it is lost the same way (``StreamStalled``, retryable; see
``ResponseStream.set_stall_timeout``): ``Migration.arm`` gives each of the request's streams
that bound, and none to a stream that could not move (no migration left, or a request that
cannot be resumed), which waits as before.

Never migrated: a stopped or killed request (its caller left, its deadline passed), a
non-retryable error, an error terminal (``finish_reason="error"``, which is an output), and a
request ``resumable`` says cannot be resumed (those end with ``EngineShutdown`` saying why).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec

from .. import errors
from ..context import Context
from ._messages import PreprocessedRequest, Resume, RoutingHints
from ._routing import ModelRouter, OutputStream, RouteOptions

__all__ = [
    "DEFAULT_MIGRATION_LIMIT",
    "DEFAULT_STALL_TIMEOUT",
    "MIGRATION_WAIT",
    "Migration",
    "continuation",
    "resumable",
]

log = logging.getLogger(__name__)

#: Migrations a request may make by default (``--migration-limit``; 0 turns migration off).
DEFAULT_MIGRATION_LIMIT = 3
#: Seconds a started stream may bring nothing before it counts as lost and migrates
#: (``--stream-stall-timeout``). A healthy engine's outputs come milliseconds apart, and even a
#: long prefill chunk or a preemption's recompute pauses a running request for seconds, not
#: ten; a prompt's own prefill or a queue is never a stall (it comes before the first output).
DEFAULT_STALL_TIMEOUT = 10.0
#: Seconds a migration waits for an instance it may go to (one restarting on the same port, or
#: one not discovered yet) when none is live (never beyond the request's deadline).
MIGRATION_WAIT = 10.0


def resumable(request: PreprocessedRequest) -> str | None:
    """Why ``request`` cannot continue on another worker from its generated tokens (None: it
    can). The one place that says so; docs/operations.md lists the reasons.

    - presence or frequency penalties count the generated tokens, which a resumed request's
      engine would see as prompt (repetition penalty covers prompt and output alike: fine);
    - ``n`` > 1: several sequences share the stream;
    - native processing (``output.detokenize``): the engine makes the text, and what it held
      back (a partial character) cannot be replayed on another worker;
    - constrained decoding (``guided``): the grammar's state after the generated tokens is not
      carried, and restarting the grammar on them as prompt would constrain the wrong text.
    """
    sampling = request.sampling
    if sampling.presence_penalty or sampling.frequency_penalty:
        return ("presence/frequency penalties count generated tokens, which another worker "
                "would see as prompt")
    if sampling.n > 1:
        return f"it asks for n={sampling.n} sequences"
    if request.output.detokenize:
        return "its engine makes the text itself (native processing)"
    if request.guided is not None:
        return "its structured-output constraint's state is not carried to another worker"
    return None


def continuation(
    request: PreprocessedRequest, generated: list[int]
) -> PreprocessedRequest | None:
    """What to send to continue ``request`` (the caller's, not modified) after ``generated``:
    its prompt extended by them, what is left of its token budget, and a ``Resume`` saying how
    many prompt tokens are output already streamed. None: the budget is spent."""
    g = len(generated)
    stop = request.stop
    max_tokens = stop.max_tokens
    if max_tokens is not None:
        max_tokens -= g
        if max_tokens < 1:
            return None
    return msgspec.structs.replace(
        request,
        token_ids=[*request.token_ids, *generated],
        stop=msgspec.structs.replace(
            stop, max_tokens=max_tokens, min_tokens=max(0, stop.min_tokens - g)
        ),
        routing=RoutingHints(),
        # the prompt's logprobs went out with the first output already
        output=msgspec.structs.replace(request.output, prompt_logprobs=None),
        resume=Resume(generated=g, min_tokens=stop.min_tokens),
    )


class Migration:
    """One request's migration state. Its caller reads the request's outputs from the stream
    the router returned, adds each output's token ids to ``generated`` (one ``extend`` per
    output: the only steady-state cost), and stops at the terminal output; when the stream
    fails, ``recover`` gives the stream to go on with.

    Args:
        router: the model's router, to send the continuation.
        request: the request as the caller made it (never modified).
        limit: migrations allowed.
        idle_timeout: as given to the router.
        deadline: the loop time the request's deadline passes at (None: no deadline); a
            continuation gets what is left of it as its timeout.
        on_migrate: called with the error kind of each migration (metrics).
        stall_timeout: seconds a stream may bring nothing before it is lost (``arm``); None:
            streams are never judged stalled.
        options: how the request was routed: a continuation keeps its session (it pins the
            session to the new worker), its allowed and excluded instances.
    """

    __slots__ = (
        "_deadline", "_idle_timeout", "_limit", "_lost", "_on_migrate", "_options", "_request",
        "_router", "_stall", "generated", "link", "migrations",
    )

    def __init__(
        self,
        router: ModelRouter,
        request: PreprocessedRequest,
        limit: int,
        idle_timeout: float | None = None,
        deadline: float | None = None,
        on_migrate: Callable[[str], object] | None = None,
        stall_timeout: float | None = None,
        options: RouteOptions | None = None,
    ) -> None:
        self._router = router
        self._options = RouteOptions() if options is None else options.replace(instance_id=None)
        self._request = request
        self._limit = limit
        self._idle_timeout = idle_timeout
        self._deadline = deadline
        self._on_migrate = on_migrate
        self._stall = stall_timeout if stall_timeout and resumable(request) is None else None
        #: The token ids handed to the client so far, across workers.
        self.generated: list[int] = []
        self._lost: set[int] = set()
        #: Migrations made so far.
        self.migrations = 0
        #: With tracing on: the ``worker_trace_link`` of the request's first output with tokens
        #: (its first worker's ``engine.generate``), which a continuation links to.
        self.link: str | None = None

    def arm(self, stream: OutputStream) -> OutputStream:
        """Give ``stream`` (the request's, now) the stall timeout, if a stall could still move
        it to another worker; returns it."""
        if self._stall is not None:
            stream.set_stall_timeout(self._stall if self.migrations < self._limit else None)
        return stream

    async def recover(self, stream: OutputStream, exc: errors.DynamoError) -> OutputStream:
        """The stream to continue ``stream``'s request on, after it failed with ``exc``.

        Raises:
            DynamoError: ``exc`` when the request is not to be migrated (see the module
                docstring), or ``EngineShutdown`` saying why it cannot be resumed.
        """
        ctx = stream.context
        generated = self.generated
        if not exc.retryable or ctx.is_stopped() or self.migrations >= self._limit:
            raise exc
        lost = stream.instance_id
        if not generated:
            # The runtime's failover gave up before any output (no other instance at that
            # moment, e.g. several lost at once): send the request again, unchanged, once one is.
            self._lost.add(lost)
            log.info("request %s: its worker (%x) was lost before any output (%s); sending it "
                     "again (%d of at most %d)", ctx.id(), lost, exc.kind, self.migrations + 1,
                     self._limit)
            new = await self._reopen(
                msgspec.structs.replace(self._request, routing=RoutingHints()), ctx, exc
            )
            self.migrations += 1
            if self._on_migrate is not None:
                self._on_migrate(exc.kind)
            return self.arm(new)
        why = (f"the worker serving it ({lost:x}) was lost after {len(generated)} tokens "
               f"({exc.kind}: {exc.message})")
        if (reason := resumable(self._request)) is not None:
            raise errors.EngineShutdown(f"{why}; it cannot be resumed elsewhere: {reason}") from exc
        request = continuation(self._request, list(generated))
        if request is None:
            raise errors.EngineShutdown(
                f"{why}; its token budget is spent but its end was lost"
            ) from exc
        self._lost.add(lost)
        log.info("request %s: %s; migrating (%d of at most %d)", ctx.id(), why,
                 self.migrations + 1, self._limit)
        new = await self._reopen(request, ctx, exc)
        self.migrations += 1
        if self._on_migrate is not None:
            self._on_migrate(exc.kind)
        return self.arm(new)

    async def _reopen(
        self, request: PreprocessedRequest, ctx: Context, exc: errors.DynamoError
    ) -> OutputStream:
        """Send the continuation, waiting up to ``MIGRATION_WAIT`` for an instance not lost."""
        if self.link is not None:
            request = msgspec.structs.replace(request, migration_link=self.link)
        loop = asyncio.get_running_loop()
        wait_until = loop.time() + MIGRATION_WAIT
        exclude = frozenset(self._lost)
        while True:
            left = None
            if self._deadline is not None:
                left = self._deadline - loop.time()
                if left <= 0:
                    raise exc
            options = self._options.replace(idle_timeout=self._idle_timeout, timeout=left,
                                            exclude=exclude | self._options.exclude)
            try:
                return await self._router.generate(request, ctx, options)
            except errors.CannotConnect:
                if ctx.is_stopped() or loop.time() >= wait_until:
                    raise exc from None
            await asyncio.sleep(0.1)  # a migration only: a bounded poll for a new instance
