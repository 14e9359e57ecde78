"""The frontend's ``kv`` and ``approx`` router modes, as a ``RouterPlugin`` (registered in the
``dynamo_zmq.routers`` entry-point group): ``python -m dynamo_zmq.frontend --router-mode kv``."""

from __future__ import annotations

import argparse

from prometheus_client import CollectorRegistry

from dynamo_zmq.llm import ModelRouter, RouterPlugin, RoutingTarget, SessionPins

from .kv_router import KvRouter, KvRouterConfig
from .metrics import RouterMetrics
from .options import add_kv_router_args, check_kv_router_args, kv_router_options

__all__ = ["DEFAULT_BLOCK_SIZE", "KvRouting"]

#: Block size of a model whose card and engine say none.
DEFAULT_BLOCK_SIZE = 16


class KvRouting(RouterPlugin):
    """KV-cache-aware routing: ``kv`` indexes the engines' KV events, ``approx`` (the same as
    ``kv --no-kv-events``) indexes the router's own decisions."""

    def __init__(self, config: KvRouterConfig) -> None:
        self.config = config
        self._metrics: dict[int, RouterMetrics] = {}

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        add_kv_router_args(parser)

    @classmethod
    def from_args(cls, mode: str, args: argparse.Namespace) -> KvRouting:
        check_kv_router_args(args)
        options = kv_router_options(args)
        if mode == "approx":
            options["use_kv_events"] = False
        return cls(KvRouterConfig(**options))

    async def router(self, target: RoutingTarget) -> ModelRouter:
        """A started ``KvRouter`` for the target's model; its block size comes from the model's
        advert (card, else engine), else ``DEFAULT_BLOCK_SIZE``; it pins sessions as
        ``target.sessions`` says."""
        name, sessions = target.advert.name, target.sessions
        pins = (SessionPins(sessions, model=name, registry=target.registry)
                if sessions.enabled else None)
        router = KvRouter(
            target.client, target.advert.kv_block_size or DEFAULT_BLOCK_SIZE, self.config,
            metrics=self._metrics_for(target.registry), model=name, runtime=target.runtime,
            sessions=pins,
        )
        return await router.start()

    def _metrics_for(self, registry: CollectorRegistry | None) -> RouterMetrics:
        """One ``RouterMetrics`` per registry (a registry takes each series once)."""
        key = id(registry)
        if key not in self._metrics:
            self._metrics[key] = RouterMetrics(registry)
        return self._metrics[key]
