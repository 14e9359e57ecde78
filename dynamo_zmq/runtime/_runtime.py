"""Dynamo-compatible runtime API: ``DistributedRuntime -> Namespace -> Component -> Endpoint``.

A Dynamo Python worker ports by changing its import::

    from dynamo_zmq.runtime import DistributedRuntime, dynamo_worker, dynamo_endpoint, Context

    @dynamo_worker()
    async def worker(runtime: DistributedRuntime):
        endpoint = runtime.namespace("demo").component("backend").endpoint("generate")
        await endpoint.serve_endpoint(handler)   # serves until the runtime shuts down

and a caller::

    client = await runtime.endpoint("demo.backend.generate").client()
    await client.wait_for_instances()
    async for response in await client.generate({"prompt": "hi"}):
        print(response.data())

One ROUTER socket per process serves every endpoint; calls go peer to peer over one DEALER per
remote process. Discovery (mDNS or a static list) and liveness replace etcd and NATS.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import secrets
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import zmq

from .. import errors
from ..context import Context
from ..discovery import Advert, Discovery, make_discovery
from ..transport import Handler as TransportHandler
from ..transport import PeerConnection, Server
from ..wire import PROTOCOL_VERSION, Description, EndpointInfo, decode_item
from ._client import Client, RouterMode
from ._config import RuntimeConfig
from ._peers import PeerPool

__all__ = [
    "Client",
    "Component",
    "Context",
    "DistributedRuntime",
    "Endpoint",
    "Namespace",
    "RouterMode",
    "check_name",
    "dynamo_endpoint",
    "dynamo_worker",
]

log = logging.getLogger(__name__)


class DistributedRuntime:
    """The per-process runtime: one request-plane socket, discovery, and peer connections.

    Accepts Dynamo's constructor arguments ``(event_loop, discovery_backend, request_plane,
    enable_nats)``; ``discovery_backend`` may be ``"mdns"`` or ``"static"`` (Dynamo's etcd /
    kubernetes / file backends need infrastructure this project replaces, so they fall back to
    the configured default). Pass ``config=`` for full control.
    """

    def __init__(
        self,
        event_loop: asyncio.AbstractEventLoop | None = None,
        discovery_backend: str | None = None,
        request_plane: str | None = None,
        enable_nats: bool | None = None,
        *,
        config: RuntimeConfig | None = None,
    ) -> None:
        if config is None:
            config = RuntimeConfig.from_env()
            if discovery_backend in ("mdns", "static"):
                disc = dataclasses.replace(config.discovery, backend=discovery_backend)
                config = dataclasses.replace(config, discovery=disc)
            elif discovery_backend is not None:
                log.info("discovery backend %r maps to %r here", discovery_backend, config.discovery.backend)
        self.config = config
        self.instance_id = secrets.randbits(63) or 1
        self.started_at = time.time()
        self.metadata: dict[str, Any] = {}
        self._zctx = zmq.Context(io_threads=1)
        self._discovery: Discovery = make_discovery(config.discovery)
        self._discovery_started = False
        self._server: Server | None = None
        self._handlers: dict[str, TransportHandler] = {}
        self._endpoint_info: dict[str, EndpointInfo] = {}
        self._advertised: dict[str, Advert] = {}
        self._peers: PeerPool | None = None
        self._shutdown = asyncio.Event()
        self._closed = False
        self._lock = asyncio.Lock()

    # -- naming ----------------------------------------------------------------------------

    def namespace(self, name: str) -> Namespace:
        return Namespace(self, check_name(name, "namespace"))

    def endpoint(self, path: str) -> Endpoint:
        """``"ns.component.endpoint"`` (or ``"dyn://ns.component.endpoint"``)."""
        parts = path.removeprefix("dyn://").split(".")
        if len(parts) != 3:
            raise errors.InvalidArgument(f"endpoint path {path!r} is not namespace.component.endpoint")
        return self.namespace(parts[0]).component(parts[1]).endpoint(parts[2])

    # -- serving ---------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The bound ``tcp://host:port`` of the request plane ('' before anything is served)."""
        return self._server.address if self._server else ""

    async def _ensure_server(self) -> Server:
        async with self._lock:
            if self._server is None:
                bind = f"tcp://{self.config.bind_host}:{self.config.port}"
                server = Server(self._zctx, bind, self.instance_id, self._handlers.get, self.describe)
                await server.start()
                self._server = server
                log.info("instance %x serving on %s", self.instance_id, server.address)
            return self._server

    async def _ensure_discovery(self) -> Discovery:
        if not self._discovery_started:
            self._discovery_started = True
            await self._discovery.start()
        return self._discovery

    def describe(self) -> Description:
        """This process's full description (what DESCRIBE answers)."""
        return Description(
            instance_id=self.instance_id,
            protocol_version=PROTOCOL_VERSION,
            rev=self._server.rev if self._server else 0,
            started_at=self.started_at,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            endpoints=list(self._endpoint_info.values()),
            draining=self._server.draining if self._server else False,
            metadata=self.metadata,
        )

    async def _add_endpoint(self, info: EndpointInfo, handler: TransportHandler) -> None:
        server = await self._ensure_server()
        self._handlers[info.path] = handler
        self._endpoint_info[info.path] = info
        server.bump_rev()
        await self._advertise(info.namespace)

    async def _remove_endpoint(self, path: str) -> None:
        info = self._endpoint_info.pop(path, None)
        self._handlers.pop(path, None)
        if info is None or self._server is None:
            return
        self._server.bump_rev()
        if any(e.namespace == info.namespace for e in self._endpoint_info.values()):
            await self._advertise(info.namespace)
        else:
            advert = self._advertised.pop(info.namespace, None)
            if advert is not None:
                await self._discovery.withdraw(advert)

    async def _advertise(self, namespace: str) -> None:
        assert self._server is not None
        port = self._server.address.rsplit(":", 1)[1]
        components = tuple(
            sorted({e.component for e in self._endpoint_info.values() if e.namespace == namespace})
        )
        advert = Advert(
            namespace=namespace,
            instance_id=self.instance_id,
            addresses=tuple(f"tcp://{h}:{port}" for h in self.config.advertised_hosts()),
            components=components,
        )
        if self._advertised.get(namespace) != advert:
            await self._ensure_discovery()
            await self._discovery.advertise(advert)
            self._advertised[namespace] = advert

    # -- calling ---------------------------------------------------------------------------

    async def _pool(self, namespace: str | None) -> PeerPool:
        if self._peers is None:
            await self._ensure_discovery()
            self._peers = PeerPool(self._zctx, self._discovery)
        self._peers.watch(namespace)
        return self._peers

    async def peers(self, namespace: str | None = None) -> list[PeerConnection]:
        """Connections to every discovered process (``None``: all namespaces)."""
        pool = await self._pool(namespace)
        return list(pool.peers.values())

    async def wait_peers_changed(self, timeout: float | None = None) -> None:
        """Wait until any discovered peer changes (or ``timeout``)."""
        pool = await self._pool(None) if self._peers is None else self._peers
        await pool.wait_changed(timeout)

    # -- lifecycle -------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Ask the runtime to shut down: ``serve_endpoint`` calls return, then resources close."""
        self._shutdown.set()

    def is_shutdown(self) -> bool:
        return self._shutdown.is_set()

    async def wait_shutdown(self) -> None:
        await self._shutdown.wait()

    async def drain(self, timeout: float | None = None) -> bool:
        """Graceful shutdown of the serving side, in order: withdraw the adverts and tell
        connected clients to route elsewhere; wait the grace period (requests already on the
        wire are still served); refuse new requests; wait for in-flight ones to finish.

        Returns False if requests were still running when ``timeout`` expired.
        """
        for advert in list(self._advertised.values()):
            with contextlib.suppress(Exception):
                await self._discovery.withdraw(advert)
        self._advertised.clear()
        if self._server is None:
            return True
        self._server.set_draining()
        await asyncio.sleep(self.config.grace_period)
        self._server.refuse_new()
        return await self._server.wait_idle(self.config.graceful_timeout if timeout is None else timeout)

    async def close(self) -> None:
        """Withdraw adverts, close the server, peers and discovery (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._shutdown.set()
        for advert in list(self._advertised.values()):
            with contextlib.suppress(Exception):
                await self._discovery.withdraw(advert)
        self._advertised.clear()
        if self._server is not None:
            await self._server.close()
        if self._peers is not None:
            await self._peers.close()
        await self._discovery.close()
        self._zctx.destroy(linger=0)

    async def __aenter__(self) -> DistributedRuntime:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class Namespace:
    def __init__(self, runtime: DistributedRuntime, name: str) -> None:
        self.runtime = runtime
        self.name = name

    def component(self, name: str) -> Component:
        return Component(self, check_name(name, "component"))

    def __repr__(self) -> str:
        return f"Namespace({self.name!r})"


class Component:
    def __init__(self, namespace: Namespace, name: str) -> None:
        self._namespace = namespace
        self.runtime = namespace.runtime
        self.name = name

    def namespace(self) -> Namespace:
        return self._namespace

    def endpoint(self, name: str) -> Endpoint:
        return Endpoint(self, check_name(name, "endpoint"))

    async def create_service(self) -> None:
        """Make sure this process can serve (binds the request-plane socket)."""
        await self.runtime._ensure_server()

    def __repr__(self) -> str:
        return f"Component({self._namespace.name}.{self.name})"


class Endpoint:
    """A named, streaming entry point of a component."""

    def __init__(self, component: Component, name: str) -> None:
        self._component = component
        self.runtime = component.runtime
        self.namespace = component.namespace().name
        self.component_name = component.name
        self.name = name
        self.path = f"{self.namespace}.{self.component_name}.{name}"
        self._handler: Callable[..., Any] | None = None
        self._request_type: type | None = None

    def __repr__(self) -> str:
        return f"Endpoint({self.path})"

    def component(self) -> Component:
        return self._component

    def connection_id(self) -> int:
        """This process's instance id."""
        return self.runtime.instance_id

    async def start_serving(
        self,
        handler: Callable[..., Any],
        metadata: dict[str, Any] | None = None,
        request_type: type | None = None,
    ) -> None:
        """Register ``handler`` and advertise it; returns at once (see ``serve_endpoint``).

        With ``request_type`` (a msgspec Struct), requests are decoded and validated straight
        into that type; a request that does not fit fails with InvalidArgument.
        """
        self._handler = handler
        self._request_type = request_type
        info = EndpointInfo(self.namespace, self.component_name, self.name, metadata or {})
        await self.runtime._add_endpoint(info, _adapt_handler(handler, request_type))

    async def serve_endpoint(
        self,
        handler: Callable[..., Any],
        graceful_shutdown: bool = True,
        metrics_labels: list[tuple[str, str]] | None = None,
        health_check_payload: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        """Serve ``handler`` until the runtime shuts down (Dynamo's blocking form).

        ``handler(request)`` or ``handler(request, context)`` is an async generator; what it
        yields streams back to the caller. With ``graceful_shutdown`` the call returns only after
        in-flight requests finished (bounded by the runtime's graceful timeout).
        """
        meta = dict(metadata or {})
        if health_check_payload is not None:
            meta["health_check_payload"] = health_check_payload
        await self.start_serving(handler, meta)
        await self.runtime.wait_shutdown()
        if graceful_shutdown:
            await self.runtime.drain()
        await self.runtime._remove_endpoint(self.path)

    async def unregister_endpoint_instance(self) -> None:
        """Stop routing new requests here (the socket keeps serving what is in flight)."""
        await self.runtime._remove_endpoint(self.path)

    async def register_endpoint_instance(self) -> None:
        if self._handler is None:
            raise errors.InvalidArgument(f"{self.path} has no handler to register")
        await self.start_serving(self._handler, request_type=self._request_type)

    async def client(
        self,
        router_mode: str | None = None,
        select: Callable[[PeerConnection], bool] | None = None,
    ) -> Client:
        """A client for every live instance of this endpoint (default: round-robin).

        ``select`` narrows the instances further, e.g. to those serving one model.
        """
        pool = await self.runtime._pool(self.namespace)
        return Client(self.path, pool, router_mode or RouterMode.RoundRobin, select)


# -- handlers -------------------------------------------------------------------------------


def _adapt_handler(handler: Callable[..., Any], request_type: type | None = None) -> TransportHandler:
    """Wrap a user handler ``(request)`` or ``(request, context)`` for the transport."""
    wants_context = _accepts_context(handler)
    decode = decode_item if request_type is None else msgspec.msgpack.Decoder(request_type).decode

    def run(payload: msgspec.Raw, ctx: Context) -> AsyncIterator[Any]:
        # A plain function, so the handler's own async generator is what the server iterates:
        # no extra generator layer per item.
        try:
            request = decode(payload)
        except msgspec.ValidationError as exc:
            raise errors.InvalidArgument(f"invalid request: {exc}") from exc
        except (msgspec.DecodeError, RecursionError) as exc:
            raise errors.InvalidArgument(f"request is not valid MessagePack: {exc}") from exc
        result = handler(request, ctx) if wants_context else handler(request)
        if hasattr(result, "__aiter__"):
            return result  # type: ignore[no-any-return]
        if inspect.isawaitable(result):
            return _single(result)
        raise errors.Unknown(f"handler returned {type(result).__name__}, not an async iterator")

    return run


async def _single(result: Any) -> AsyncIterator[Any]:
    """A handler that is a plain coroutine answers with one response."""
    yield await result


def _accepts_context(handler: Callable[..., Any]) -> bool:
    try:
        params = list(inspect.signature(handler).parameters.values())
    except (TypeError, ValueError):
        return False
    if any(p.name == "context" for p in params):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


def check_name(name: str, what: str) -> str:
    """``name`` if it can be a namespace, component or endpoint name, else InvalidArgument."""
    if not name or "." in name or any(c.isspace() for c in name):
        raise errors.InvalidArgument(f"{what} name {name!r} must be non-empty, without dots or spaces")
    return name


# -- decorators (Dynamo's) ------------------------------------------------------------------


def dynamo_worker(*_args: Any, **_kwargs: Any) -> Callable[..., Any]:
    """Run the decorated ``async def worker(runtime, ...)`` with a fresh runtime.

    SIGINT/SIGTERM shut the runtime down (``serve_endpoint`` returns after draining); the
    runtime is closed when the function returns.
    """

    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            loop = asyncio.get_running_loop()
            runtime = DistributedRuntime(loop)
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, runtime.shutdown)
            try:
                return await func(runtime, *args, **kwargs)
            finally:
                await runtime.close()

        return wrapper

    return decorator


def dynamo_endpoint(request_model: Any, response_model: Any) -> Callable[..., Any]:
    """Validate requests into ``request_model`` (pydantic or msgspec) before the handler runs."""

    def parse(value: Any) -> Any:
        if isinstance(value, request_model):
            return value
        try:
            if hasattr(request_model, "model_validate"):  # pydantic v2
                return request_model.model_validate(value)
            if isinstance(request_model, type) and issubclass(request_model, msgspec.Struct):
                return msgspec.convert(value, request_model)
        except Exception as exc:
            raise errors.InvalidArgument(f"invalid request: {exc}") from exc
        return value

    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        async def wrapper(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            args_list = list(args)
            # (request), (self, request), (request, context) or (self, request, context)
            index = 1 if len(args_list) == 3 or (len(args_list) == 2 and not isinstance(args_list[1], Context)) else 0
            args_list[index] = parse(args_list[index])
            async for item in func(*args_list, **kwargs):
                yield item

        return wrapper

    return decorator
