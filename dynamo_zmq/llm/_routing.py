"""How one model's requests reach its workers: the ``ModelRouter`` interface every routing mode
implements, the built-in modes (round-robin, random, direct) and the plugin base for the others.

The frontend makes one ``ModelRouter`` per model and calls nothing else to send a request: it
passes the request, its context and a ``RouteOptions``, and gets back a stream of decoded
``LLMEngineOutput``s. Where a router places a request inside a
worker (a data-parallel rank) it writes into ``request.routing``, which travels with it.
"""

from __future__ import annotations

import abc
import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import msgspec

from .. import errors
from ..context import Context
from ..runtime import Client, RouterMode
from ..transport import ItemStream
from ._advert import ModelAdvert
from ._messages import LLMEngineOutput, PreprocessedRequest

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from ..runtime import DistributedRuntime

__all__ = [
    "BUILTIN_MODES",
    "DEFAULT_ROUTE",
    "ClientRouter",
    "ModelRouter",
    "OutputStream",
    "RouteOptions",
    "RouterPlugin",
    "RoutingTarget",
]

OutputStream = ItemStream[LLMEngineOutput]
"""A request's engine outputs, as the worker's post-processing made them."""

#: The modes the core provides (the frontend's ``--router-mode`` names -> ``Client`` modes).
BUILTIN_MODES = {
    "round-robin": RouterMode.RoundRobin,
    "random": RouterMode.Random,
    "direct": RouterMode.Direct,
}


class RouteOptions(msgspec.Struct, frozen=True, kw_only=True):
    """How to send one request: the routing seam's one argument beside the request and its
    context (``ModelRouter.generate``). Immutable: ``replace`` makes a changed copy."""

    #: The instance chosen outside the router (``direct`` mode needs it; other modes do not
    #: read it).
    instance_id: int | None = None
    #: Seconds to wait for each next output (ResponseTimeout after).
    idle_timeout: float | None = None
    #: The runtime's per-request deadline, in seconds, which the worker enforces too
    #: (ResponseTimeout after); None: no deadline.
    timeout: float | None = None
    #: Instances the request must not go to, not even by failover (those a migrated request
    #: was lost on).
    exclude: frozenset[int] = frozenset()
    #: The only instances the request may go to (those holding its LoRA adapter); None: any.
    only: frozenset[int] | None = None
    #: The request's session (``X-Dynamo-Session-ID``): routers that pin sessions send it to
    #: the worker that served the session before. None: no session.
    session_id: str | None = None

    def replace(self, **changes: object) -> RouteOptions:
        """A copy with ``changes``."""
        return msgspec.structs.replace(self, **changes)


#: No instance named, no timeouts, nothing excluded.
DEFAULT_ROUTE = RouteOptions()


class ModelRouter(Protocol):
    """Sends one model's requests to its workers."""

    def instance_ids(self) -> list[int]:
        """The instances serving the model now, sorted."""
        ...

    async def generate(
        self, request: PreprocessedRequest, context: Context, options: RouteOptions = DEFAULT_ROUTE
    ) -> OutputStream:
        """Send ``request``; its outputs stream back.

        Args:
            request: the preprocessed request (a router may fill ``request.routing``).
            context: the request's cancellation context (stop and kill reach the worker).
            options: where it may go and how long it may take (``RouteOptions``).

        Raises:
            CannotConnect: no live instance (or not the one named).
            InvalidArgument: the request cannot be routed as given.
        """
        ...

    async def close(self) -> None:
        """Release what the router holds (subscriptions, tasks). Idempotent."""
        ...


class ClientRouter:
    """The built-in modes: round-robin, random or direct over the model's ``Client``, with its
    failover (a request whose worker fails before the first output moves to another)."""

    def __init__(self, client: Client) -> None:
        self.client = client

    def instance_ids(self) -> list[int]:
        return self.client.instance_ids()

    async def generate(
        self, request: PreprocessedRequest, context: Context, options: RouteOptions = DEFAULT_ROUTE
    ) -> OutputStream:
        instance_id = options.instance_id
        if self.client.mode == RouterMode.Direct and instance_id is None:
            raise errors.InvalidArgument("direct routing needs the instance to send to")
        if self.client.mode != RouterMode.Direct:
            instance_id = None
        return await self.client.stream(
            request, LLMEngineOutput, context=context, instance_id=instance_id,
            timeout=options.timeout, idle_timeout=options.idle_timeout, exclude=options.exclude,
            only=options.only,
        )

    async def close(self) -> None:
        """Nothing to release."""


@dataclass(frozen=True)
class RoutingTarget:
    """What a router plugin routes for: one model of one frontend (or router service)."""

    runtime: DistributedRuntime
    #: A client of the model's endpoint, narrowed to the instances serving the model.
    client: Client
    #: The model as one of its instances advertises it (name, block size, engine).
    advert: ModelAdvert
    #: Where the router's metrics go (the frontend's registry); None: a private one.
    registry: CollectorRegistry | None = None


class RouterPlugin(abc.ABC):
    """A routing mode another package provides (entry-point group ``dynamo_zmq.routers``, the
    entry point's name being the mode). One plugin object serves a whole frontend: its
    ``router`` makes the ``ModelRouter`` of each model."""

    @classmethod  # noqa: B027 (optional hook)
    def add_args(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        """Add the plugin's flags (called once per plugin class, whatever the mode chosen)."""

    @classmethod
    @abc.abstractmethod
    def from_args(cls, mode: str, args: argparse.Namespace) -> RouterPlugin:
        """The plugin for ``mode`` configured from the parsed flags.

        Raises:
            InvalidArgument: a flag's value cannot work (the frontend exits 2 with the message).
        """

    @abc.abstractmethod
    async def router(self, target: RoutingTarget) -> ModelRouter:
        """A started router for one model."""
