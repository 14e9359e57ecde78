"""Disaggregated prefill and decode on the frontend (``DisaggRouter``, a ``ModelRouter``).

A model's workers come in three roles (their card's ``role``): ``agg`` and ``decode`` workers
form the generation pool, which every request ends on; ``prefill`` workers form the prefill
pool, which never gets an ordinary request. Once a model has a prefill pool, the frontend wraps
its generation router in a ``DisaggRouter``: a request first goes to a prefill worker (chosen by
the prefill pool's router: KV overlap in kv mode, load or round-robin otherwise) as a copy
that asks for one token (``stop.max_tokens = 1``) with ``disaggregation = DecodeRemotely()``;
the engine's terminal output carries the KV handoff (``kv_handoff``). The request then goes to
the generation pool with ``disaggregation = PrefillRemotely(handoff)`` (None without a
handoff: the decode worker prefills locally), and its stream is what the caller reads: one
ordinary stream.

The prefill runs under a child of the request's context (``Context.link_child``), so a client
that goes away, or a deadline that passes, stops it on the prefill worker. A prefill that fails
(an error, its worker lost, ``--disagg-prefill-timeout``) is not the request's failure: the
request goes on to the decode worker without a handoff, and is counted.

Conditional disaggregation (Dynamo's rule): in ``conditional`` mode the prefill stays local
when the prompt's uncached part is at most ``max_local_prefill_tokens`` (uncached: what the
generation pool's KV router finds not cached on the worker it would choose, in kv mode; the
whole prompt otherwise) or when the prefill pool is busy (more than ``max_prefill_queue``
remote prefills in flight from this frontend per prefill worker). ``always`` skips both checks;
``never`` keeps every prefill local.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from dataclasses import dataclass

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .. import errors
from ..context import Context
from ..llm import (
    DEFAULT_ROUTE,
    DecodeRemotely,
    KvHandoff,
    ModelRouter,
    OutputStream,
    PrefillRemotely,
    PreprocessedRequest,
    RouteOptions,
    RoutingHints,
)
from ..runtime import check_number

__all__ = [
    "DISAGG_MODES",
    "GENERATION_ROLES",
    "PREFILL_ROLES",
    "DisaggConfig",
    "DisaggMetrics",
    "DisaggRouter",
    "add_disagg_args",
    "disagg_config",
    "prefill_request",
]

log = logging.getLogger(__name__)

#: ``--disagg-mode`` values.
DISAGG_MODES = ("conditional", "always", "never")
#: Roles of the generation pool (serves a model's requests) and of its prefill pool.
GENERATION_ROLES = frozenset({"agg", "decode"})
PREFILL_ROLES = frozenset({"prefill"})
#: Why a request of a model with a prefill pool was prefilled on its decode worker.
LOCAL_REASONS = ("short", "busy", "no_pool", "failed", "never", "migrated")

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass(frozen=True)
class DisaggConfig:
    """When a request is prefilled remotely (the frontend's ``--disagg-*`` flags)."""

    #: ``conditional`` (Dynamo's rule), ``always`` or ``never``.
    mode: str = "conditional"
    #: Uncached prompt tokens at or below this are prefilled on the decode worker.
    max_local_prefill_tokens: int = 512
    #: Remote prefills in flight per prefill worker above which the pool counts as busy.
    max_prefill_queue: int = 2
    #: Seconds a remote prefill may take before the decode worker prefills instead.
    prefill_timeout: float = 60.0


def add_disagg_args(parser: argparse.ArgumentParser) -> None:
    """The frontend's ``--disagg-*`` flags (each with its ``DYN_*`` variable)."""
    env, d = os.environ.get, DisaggConfig()
    group = parser.add_argument_group("disaggregated prefill (models with prefill workers)")
    group.add_argument(
        "--disagg-mode", choices=DISAGG_MODES, default=env("DYN_DISAGG_MODE", d.mode),
        help="conditional: remote prefill unless the prompt's uncached part is short or the "
             "prefill pool is busy; always; never [DYN_DISAGG_MODE]",
    )
    group.add_argument(
        "--disagg-max-local-prefill-tokens", type=int,
        default=env("DYN_DISAGG_MAX_LOCAL_PREFILL_TOKENS", str(d.max_local_prefill_tokens)),
        help="conditional mode: uncached prompt tokens at or below this are prefilled on the "
             "decode worker [DYN_DISAGG_MAX_LOCAL_PREFILL_TOKENS]",
    )
    group.add_argument(
        "--disagg-max-prefill-queue", type=int,
        default=env("DYN_DISAGG_MAX_PREFILL_QUEUE", str(d.max_prefill_queue)),
        help="conditional mode: the prefill pool is busy (prefill locally) above this many "
             "remote prefills in flight per prefill worker [DYN_DISAGG_MAX_PREFILL_QUEUE]",
    )
    group.add_argument(
        "--disagg-prefill-timeout", type=float,
        default=env("DYN_DISAGG_PREFILL_TIMEOUT", str(d.prefill_timeout)),
        help="seconds a remote prefill may take before the decode worker prefills instead "
             "[DYN_DISAGG_PREFILL_TIMEOUT]",
    )


def disagg_config(args: argparse.Namespace) -> DisaggConfig:
    """The configuration the parsed flags give.

    Raises:
        InvalidArgument: a value out of range.
    """
    if args.disagg_mode not in DISAGG_MODES:  # from the environment, unchecked by argparse
        raise errors.InvalidArgument(
            f"--disagg-mode must be one of {', '.join(DISAGG_MODES)}, got {args.disagg_mode!r}"
        )
    for flag, value in (
        ("--disagg-max-local-prefill-tokens", args.disagg_max_local_prefill_tokens),
        ("--disagg-max-prefill-queue", args.disagg_max_prefill_queue),
    ):
        if value < 0:
            raise errors.InvalidArgument(f"{flag} must be >= 0, got {value}")
    check_number("--disagg-prefill-timeout", args.disagg_prefill_timeout, positive=True)
    return DisaggConfig(
        args.disagg_mode, args.disagg_max_local_prefill_tokens, args.disagg_max_prefill_queue,
        args.disagg_prefill_timeout,
    )


class DisaggMetrics:
    """The frontend's disaggregation metrics (in its registry), labelled by model."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.remote = Counter(
            "dynamo_frontend_remote_prefills",
            "Requests whose prompt a prefill worker prefilled", ["model"], registry=r,
        )
        self.local = Counter(
            "dynamo_frontend_local_prefills",
            "Requests of a model with prefill workers prefilled on their decode worker, by "
            "reason (short, busy, no_pool, failed, never, migrated)", ["model", "reason"],
            registry=r,
        )
        self.seconds = Histogram(
            "dynamo_frontend_prefill_seconds", "Duration of successful remote prefills",
            ["model"], buckets=_SECONDS, registry=r,
        )
        self.inflight = Gauge(
            "dynamo_frontend_prefill_inflight_requests", "Remote prefills in flight", ["model"],
            registry=r,
        )


def prefill_request(request: PreprocessedRequest) -> PreprocessedRequest:
    """The copy of ``request`` a prefill worker gets: one token, asking to keep the KV for a
    remote decode; routing hints of its own, and nothing that only shapes the output."""
    return msgspec.structs.replace(
        request,
        stop=msgspec.structs.replace(request.stop, max_tokens=1, min_tokens=0),
        disaggregation=DecodeRemotely(),
        routing=RoutingHints(),
        guided=None,
        tools=None,
        reasoning=False,
    )


class DisaggRouter:
    """A model's ``ModelRouter`` once it has a prefill pool: prefill there, then decode on the
    generation pool (see the module docstring).

    Args:
        generation: the router of the model's agg and decode workers.
        prefill: the router of its prefill workers.
        config: when to prefill remotely.
        metrics: the frontend's disaggregation metrics.
        model: the model name (metrics label).
    """

    def __init__(
        self,
        generation: ModelRouter,
        prefill: ModelRouter,
        config: DisaggConfig,
        metrics: DisaggMetrics,
        model: str,
    ) -> None:
        self.generation = generation
        self.prefill = prefill
        self.config = config
        self.model = model
        self._remote = metrics.remote.labels(model)
        self._local = {reason: metrics.local.labels(model, reason) for reason in LOCAL_REASONS}
        self._seconds = metrics.seconds.labels(model)
        self._inflight_gauge = metrics.inflight.labels(model)
        #: Remote prefills in flight from this frontend.
        self.inflight = 0

    def instance_ids(self) -> list[int]:
        """The generation pool's instances (prefill workers never serve a request alone)."""
        return self.generation.instance_ids()

    def prefill_instance_ids(self) -> list[int]:
        return self.prefill.instance_ids()

    async def generate(
        self, request: PreprocessedRequest, context: Context, options: RouteOptions = DEFAULT_ROUTE
    ) -> OutputStream:
        reason = None
        if request.embedding is None:  # an embedding has no prefill to move
            reason = self.local_reason(request, options.only)
            if reason is None:
                handoff, ok, link = await self._prefill(request, context, options)
                if ok:
                    self._remote.inc()
                else:
                    reason = "failed"
                if handoff is not None:
                    request = msgspec.structs.replace(
                        request, disaggregation=PrefillRemotely(handoff),
                        migration_link=link,  # the decode's engine.generate links to the prefill
                    )
        stream = await self.generation.generate(request, context, options)
        if reason is not None:  # counted once sent: a migration may try several times
            self._local[reason].inc()
        return stream

    async def close(self) -> None:
        """Close both pools' routers."""
        try:
            await self.prefill.close()
        finally:
            await self.generation.close()

    def local_reason(
        self, request: PreprocessedRequest, only: frozenset[int] | None = None
    ) -> str | None:
        """Why ``request`` is to be prefilled on its decode worker (None: remotely); ``only``:
        the prefill workers it may go to (those holding its LoRA adapter; None: any)."""
        cfg = self.config
        if cfg.mode == "never":
            return "never"
        if request.resume is not None:  # a migrated request: its decode worker prefills
            return "migrated"
        workers = len([i for i in self.prefill.instance_ids() if only is None or i in only])
        if not workers:
            return "no_pool"
        if cfg.mode == "always":
            return None
        if self.inflight > cfg.max_prefill_queue * workers:
            return "busy"
        if self.uncached_tokens(request) <= cfg.max_local_prefill_tokens:
            return "short"
        return None

    def uncached_tokens(self, request: PreprocessedRequest) -> int:
        """The prompt tokens the generation pool would have to prefill: beyond the overlap its
        KV router finds on the worker it would choose (a router with ``best_worker``, as kv
        mode's), else the whole prompt."""
        total = len(request.token_ids)
        best_worker = getattr(self.generation, "best_worker", None)
        block_size = getattr(self.generation, "block_size", 0)
        if best_worker is None or not block_size:
            return total
        try:
            lora = {} if request.lora_name is None else {"lora_name": request.lora_name}
            overlap: int = best_worker(request.token_ids, **lora).overlap_blocks
        except errors.DynamoError:
            return total
        return max(0, total - overlap * block_size)

    async def _prefill(
        self,
        request: PreprocessedRequest,
        context: Context,
        options: RouteOptions,
    ) -> tuple[KvHandoff | None, bool, str | None]:
        """Run the remote prefill: (its handoff, whether it succeeded, its ``engine.generate``
        span's ``traceparent`` with tracing on). A failure is logged and falls back; a stopped
        or killed request raises (it is not to go on).

        Raises:
            Cancelled: the request was stopped or killed meanwhile.
        """
        child = Context(f"{context.id()}-prefill")
        context.link_child(child)
        limit = self.config.prefill_timeout
        if options.timeout is not None:
            limit = min(limit, options.timeout)
        loop = asyncio.get_running_loop()
        started = loop.time()
        self.inflight += 1
        self._inflight_gauge.inc()
        why = ""
        handoff: KvHandoff | None = None
        ok = False
        link: str | None = None
        try:
            stream = await self.prefill.generate(
                prefill_request(request), child,
                RouteOptions(idle_timeout=options.idle_timeout, timeout=limit, only=options.only),
            )
            try:
                async for out in stream:
                    link = link or out.worker_trace_link
                    if out.finish_reason is None:
                        continue
                    if out.finish_reason in ("error", "cancelled"):
                        why = f"its terminal was {out.finish_reason!r} ({out.error or ''})"
                    else:
                        ok, handoff = True, out.kv_handoff
                    break
                else:
                    why = "its stream ended without a terminal"
            finally:
                await stream.aclose()
        except errors.DynamoError as exc:
            why = f"{exc.kind}: {exc.message}"
        finally:
            self.inflight -= 1
            self._inflight_gauge.dec()
        if context.is_stopped():
            child.kill()
            raise errors.Cancelled(f"request {context.id()} was cancelled during its prefill")
        if ok:
            self._seconds.observe(loop.time() - started)
        else:
            child.kill()  # whatever the prefill worker still holds for it
            log.warning("model %r: the remote prefill of request %s failed (%s); its decode "
                        "worker prefills it", self.model, context.id(), why)
        return handoff, ok, link
