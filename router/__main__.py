"""``python -m router``: the KV router as a service of its own.

    python -m router [--namespace dynamo] [--kv-overlap-score-weight 1.0]
        [--router-temperature 0.0] [--no-kv-events] [--router-replica-sync]
        [--wait-for-workers N] [--host H] [--port P] [--metrics-port P] [discovery flags]

It follows the namespace's workers as a frontend does (one ``KvRouter`` per model, each
subscribing to its workers' KV events) and serves ``<namespace>.router.best_worker``: request
``{"model": NAME, "token_ids": [...], "mdcsum": CARD?, "lora_name": ADAPTER?}`` (with an
adapter: matched under its own block hashes, among the workers advertising it), one response
``{"worker_id", "dp_rank", "overlap_blocks", "prompt_blocks", "matches": {"<worker
hex>/<rank>": blocks}, "mdcsum"}``. One card per model name, as the frontend keeps it: workers
serving a name with different model cards (checksums) are never mixed. The first card seen is
routed, and only to its workers (each other card is warned about once); once no live worker
serves it, the card of a live one replaces it. A request naming another card (``mdcsum``: the
checksum it was preprocessed for) is refused, and each answer names the card it routed. The
answer is advice: nothing is sent to the worker and no load is counted for it (the caller sends
the request, and only the caller knows when it ends); with ``--router-replica-sync`` the load
that kv-mode frontends with the flag route is counted, from their replica events. Prints
``READY <address> <instance hex>`` once serving; with ``--wait-for-workers N``, only after it
follows N workers (mDNS shows workers one by one, so a scripted start can hold its first
questions until every worker is known).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec

from dynamo_zmq import errors, tracing
from dynamo_zmq.llm import ServedModel, advert_of, served_models, serves
from dynamo_zmq.runtime import (
    DistributedRuntime,
    RuntimeConfig,
    StatusServer,
    add_runtime_args,
    check_name,
    run_main,
    setup_logging,
)
from dynamo_zmq.transport import warn_unless_own_role

from .kv_router import KvRouter, KvRouterConfig
from .metrics import RouterMetrics
from .options import add_kv_router_args, check_kv_router_args, kv_router_options
from .plugin import DEFAULT_BLOCK_SIZE

log = logging.getLogger("router")


class BestWorkerRequest(msgspec.Struct, forbid_unknown_fields=False):
    model: str
    token_ids: list[int]
    #: The model card the caller preprocessed for (a worker request's ``mdcsum``); None: the
    #: card routed here.
    mdcsum: str | None = None
    #: The LoRA adapter the request would run with (None: the base model).
    lora_name: str | None = None


class RouterService:
    """The model table (one started ``KvRouter`` per model, over the workers of one card) and
    the ``best_worker`` handler."""

    def __init__(self, runtime: DistributedRuntime, namespace: str, config: KvRouterConfig) -> None:
        self.runtime = runtime
        self.namespace = namespace
        self.config = config
        self.metrics = RouterMetrics()
        self.routers: dict[str, KvRouter] = {}
        #: The card checksum each model's router routes to.
        self.cards: dict[str, str] = {}
        #: (model, checksum) of the other cards already warned about.
        self._warned: set[tuple[str, str]] = set()
        self._res = runtime.resources.child("router-service")

    async def start(self) -> None:
        await self.runtime.peers(self.namespace)
        await self.refresh()
        self._res.spawn(self._follow(), "router-models")

    async def close(self) -> None:
        await self._res.close()
        for router in self.routers.values():
            await router.close()
        self.routers.clear()

    async def refresh(self) -> None:
        """Route every model the namespace's live workers serve, one card per name (see the
        module docstring): a new model gets a router over its first card's workers, and a
        model whose card no live worker serves any more gets one over a live card's."""
        by_name: dict[str, list[ServedModel]] = {}
        for served in served_models(await self.runtime.peers(self.namespace), self.namespace):
            by_name.setdefault(served.advert.name, []).append(served)
        for name, instances in by_name.items():
            card = self.cards.get(name)
            if card is not None and any(s.advert.checksum == card for s in instances):
                self._warn_other_cards(name, card, instances)
            else:
                await self._route(instances[0])

    async def _route(self, served: ServedModel) -> None:
        """Route ``served``'s model to the workers of ``served``'s card (replacing the router of
        a card served no more)."""
        name, path, card = served.advert.name, served.endpoint.path, served.advert.checksum
        client = await self.runtime.endpoint(path).client(select=serves(name, path, card))
        block_size = served.advert.kv_block_size or DEFAULT_BLOCK_SIZE
        router = KvRouter(client, block_size, self.config, metrics=self.metrics,
                          model=name, runtime=self.runtime)
        old, old_card = self.routers.get(name), self.cards.get(name)
        self.routers[name] = await router.start()
        self.cards[name] = card
        if old is None:
            log.info("routing model %r (card %s, block size %d)", name, card[:12], block_size)
            return
        await old.close()
        self._warned = {w for w in self._warned if w[0] != name}
        log.warning("model %r: now routed with card %s (no live worker serves card %s any "
                    "more)", name, card[:12], (old_card or "")[:12])

    def _warn_other_cards(self, name: str, card: str, instances: list[ServedModel]) -> None:
        """Warn once per card about workers serving ``name`` with a card other than ``card``."""
        for served in instances:
            other = served.advert.checksum
            if other == card or (name, other) in self._warned:
                continue
            self._warned.add((name, other))
            log.warning(
                "model %r: instance %x serves it with another model card (checksum %s) than "
                "the one routed here (checksum %s, the first seen); it is not routed to. "
                "Serve one model directory per model name.",
                name, served.instance_id, other[:12], card[:12],
            )

    async def _follow(self) -> None:
        while True:
            await self.runtime.wait_peers_changed(timeout=1.0)
            try:
                await self.refresh()
            except Exception:
                log.exception("model table refresh failed")

    def workers_followed(self) -> int:
        """Distinct worker instances the model routers follow."""
        return len({iid for router in self.routers.values() for iid in router.instance_ids()})

    async def wait_for_workers(self, n: int) -> bool:
        """Wait until ``n`` workers are followed (logging each change); False if the runtime
        shuts down first."""
        seen = -1
        while (now := self.workers_followed()) < n:
            if self.runtime.is_shutdown():
                return False
            if now != seen:
                log.info("waiting for %d workers (%d seen)", n, now)
                seen = now
            # The model table follows peers on its own task; look again on a change or soon.
            await self.runtime.wait_peers_changed(timeout=0.25)
        log.info("following %d workers", now)
        return True

    async def best_worker(self, request: BestWorkerRequest) -> AsyncIterator[dict[str, Any]]:
        router = self.routers.get(request.model)
        if router is None:
            raise errors.InvalidArgument(f"unknown model {request.model!r}")
        card = self.cards[request.model]
        if request.mdcsum is not None and request.mdcsum != card:
            raise errors.InvalidArgument(
                f"model {request.model!r} is routed here with model card {card}, not "
                f"{request.mdcsum} (its workers would refuse the request)"
            )
        if not request.token_ids:
            raise errors.InvalidArgument("token_ids must not be empty")
        try:
            lora = request.lora_name
            exclude = frozenset() if lora is None else frozenset(
                c.instance_id for c in router.instances()
                if lora not in getattr(advert_of(c, router.path), "lora_adapters", {}))
            decision = router.best_worker(request.token_ids, exclude, lora)
        except ValueError as exc:  # token ids outside uint32 (router.hashing)
            raise errors.InvalidArgument(str(exc)) from exc
        yield {**decision.to_dict(), "mdcsum": card}


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="python -m router", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--namespace", default=env("DYN_NAMESPACE", "dynamo"), help="[DYN_NAMESPACE]"
    )
    parser.add_argument(
        "--component", default=env("DYN_COMPONENT", "router"),
        help="component of the best_worker endpoint [DYN_COMPONENT]",
    )
    add_kv_router_args(parser)
    parser.add_argument(
        "--wait-for-workers", type=int, default=env("DYN_WAIT_FOR_WORKERS", "0"), metavar="N",
        help="serve only once N worker instances are followed (default 0: at once) "
             "[DYN_WAIT_FOR_WORKERS]",
    )
    parser.add_argument(
        "--metrics-port", type=int, default=env("DYN_METRICS_PORT") or None,
        help="serve /metrics, /health and /live on this port (0 = any; default off) "
             "[DYN_METRICS_PORT]",
    )
    add_runtime_args(parser)
    return parser


async def serve(args: argparse.Namespace) -> int:
    config = KvRouterConfig(**kv_router_options(args))
    runtime = DistributedRuntime(config=RuntimeConfig.from_args(args))
    warn_unless_own_role("router", "peers grant it only what those roles may do (docs/security.md)")
    service = RouterService(runtime, args.namespace, config)
    status: StatusServer | None = None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, runtime.shutdown)
    try:
        await service.start()
        if args.wait_for_workers > 0 and not await service.wait_for_workers(args.wait_for_workers):
            return 0  # shut down while waiting
        component = runtime.namespace(args.namespace).component(args.component)
        endpoint = component.endpoint("best_worker")
        await endpoint.start_serving(service.best_worker, request_type=BestWorkerRequest)
        if args.metrics_port is not None:
            status = StatusServer(
                runtime.config.bind_host, args.metrics_port, service.metrics.render,
                lambda: (bool(service.routers), {"models": sorted(service.routers)}),
            )
            status.start()
            log.info("metrics on port %d", status.port)
        print(f"READY {runtime.address} {runtime.instance_id:x}", flush=True)
        await runtime.wait_shutdown()
        await runtime.drain(timeout=5.0)
    finally:
        if status is not None:
            status.close()
        await service.close()
        await runtime.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    setup_logging()
    try:
        args = build_parser().parse_args(argv)
        RuntimeConfig.from_args(args)
        check_kv_router_args(args)
        check_name(args.namespace, "namespace")
        check_name(args.component, "component")
        if args.wait_for_workers < 0:
            raise errors.InvalidArgument("--wait-for-workers must be >= 0")
    except errors.DynamoError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    tracing.setup("dynamo-router")
    try:
        return run_main(serve(args))
    except errors.DynamoError as exc:  # e.g. a --port or --metrics-port that cannot be bound
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    finally:
        tracing.shutdown()


if __name__ == "__main__":
    sys.exit(main())
