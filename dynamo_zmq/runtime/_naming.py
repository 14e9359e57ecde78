"""Dynamo's names: ``Namespace -> Component -> Endpoint``, and what an endpoint can do
(serve a handler, register and unregister, make a client)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from .. import errors
from ..transport import DEFAULT_CALLERS, Handler, PeerConnection, parse_roles
from ..wire import EndpointInfo
from ._client import Client, RouterMode
from ._handlers import adapt_handler
from ._peers import PeerPool

__all__ = ["Component", "Endpoint", "EndpointHost", "Namespace", "check_name"]


class EndpointHost(Protocol):
    """What names need of the runtime they belong to (``DistributedRuntime``)."""

    @property
    def instance_id(self) -> int: ...

    async def create_service(self) -> None:
        """Bind the request-plane socket if it is not bound yet."""
        ...

    async def add_endpoint(
        self, info: EndpointInfo, handler: Handler, callers: frozenset[str] = DEFAULT_CALLERS
    ) -> None:
        """Serve ``handler`` as ``info.path`` (to callers whose key holds one of ``callers``)
        and advertise it."""
        ...

    async def remove_endpoint(self, path: str) -> None:
        """Stop serving ``path`` (and withdraw the advert when it was the last of its
        namespace)."""
        ...

    def watch_health(self, path: str, handler: Handler, payload: object) -> Handler:
        """Run a health canary sending ``payload`` to ``handler``; the handler to serve."""
        ...

    async def peer_pool(self, namespace: str | None) -> PeerPool:
        """The connections to the processes of ``namespace`` (discovery started)."""
        ...

    async def wait_shutdown(self) -> None: ...

    async def drain(self, timeout: float | None = None) -> bool: ...


class Namespace:
    def __init__(self, runtime: EndpointHost, name: str) -> None:
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
        await self.runtime.create_service()

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
        self._health_check_payload: Any = None
        self._callers: Iterable[str] | None = None

    def __repr__(self) -> str:
        return f"Endpoint({self.path})"

    def component(self) -> Component:
        return self._component

    def connection_id(self) -> int:
        """This process's instance id."""
        return self.runtime.instance_id

    def lease_id(self) -> int:
        """The primary lease id this endpoint is registered under (the instance id)."""
        return self.runtime.instance_id

    async def start_serving(
        self,
        handler: Callable[..., Any],
        metadata: dict[str, Any] | None = None,
        request_type: type | None = None,
        health_check_payload: Any = None,
        callers: Iterable[str] | None = None,
    ) -> None:
        """Register ``handler`` and advertise it; returns at once (see ``serve_endpoint``).

        With ``request_type`` (a msgspec Struct), requests are decoded and validated straight
        into that type; a request that does not fit fails with InvalidArgument. With a
        ``health_check_payload``, the handler itself is the endpoint's health canary: sent that
        payload whenever the endpoint is idle, it must answer, or the endpoint leaves routing
        until it does again (``runtime/_canary.py``). With auth on, only callers whose key holds
        one of the roles ``callers`` (``worker``, ``frontend``, ``router``, ``tool``; default
        worker, frontend and router) may send it requests; others get ``PermissionDenied``.
        """
        self._handler = handler
        self._request_type = request_type
        self._callers = callers
        self._health_check_payload = health_check_payload
        info = EndpointInfo(self.namespace, self.component_name, self.name, metadata or {})
        served = adapt_handler(handler, request_type)
        if health_check_payload is not None:
            served = self.runtime.watch_health(self.path, served, health_check_payload)
        await self.runtime.add_endpoint(
            info, served, DEFAULT_CALLERS if callers is None else parse_roles(callers)
        )

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
        in-flight requests finished (bounded by the runtime's graceful timeout). A
        ``health_check_payload`` makes the handler its own health canary (``start_serving``).
        """
        meta = dict(metadata or {})
        if health_check_payload is not None:
            meta["health_check_payload"] = health_check_payload
        await self.start_serving(handler, meta, health_check_payload=health_check_payload)
        await self.runtime.wait_shutdown()
        if graceful_shutdown:
            await self.runtime.drain()
        await self.runtime.remove_endpoint(self.path)

    async def unregister_endpoint_instance(self) -> None:
        """Stop routing new requests here (the socket keeps serving what is in flight)."""
        await self.runtime.remove_endpoint(self.path)

    async def register_endpoint_instance(self) -> None:
        if self._handler is None:
            raise errors.InvalidArgument(f"{self.path} has no handler to register")
        await self.start_serving(
            self._handler, request_type=self._request_type,
            health_check_payload=self._health_check_payload, callers=self._callers,
        )

    async def client(
        self,
        router_mode: str | None = None,
        select: Callable[[PeerConnection], bool] | None = None,
    ) -> Client:
        """A client for every live instance of this endpoint (default: round-robin).

        ``select`` narrows the instances further, e.g. to those serving one model.
        """
        pool = await self.runtime.peer_pool(self.namespace)
        return Client(self.path, pool, router_mode or RouterMode.RoundRobin, select)


def check_name(name: str, what: str) -> str:
    """``name`` if it can be a namespace, component or endpoint name, else InvalidArgument."""
    if not name or "." in name or any(c.isspace() for c in name):
        raise errors.InvalidArgument(
            f"{what} name {name!r} must be non-empty, without dots or spaces"
        )
    return name
