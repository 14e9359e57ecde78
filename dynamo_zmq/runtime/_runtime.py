"""``DistributedRuntime``: the per-process runtime behind Dynamo's API (``dynamo_zmq.runtime``).

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
remote process. Discovery (mDNS or a static list) and liveness replace etcd and NATS. The
runtime's primary lease (``primary_lease()``, ``_lease.py``) stands in for Dynamo's etcd lease:
its id is the instance id in every registration, discovery renews the registrations, and a lost
lease withdraws them and shuts the runtime down.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import socket
import time
from typing import Any

from .. import errors
from ..discovery import Advert, Discovery, make_discovery
from ..resources import Resources, cancel_and_wait
from ..transport import DEFAULT_CALLERS, PeerConnection, Server, enable_curve
from ..transport import Handler as TransportHandler
from ..wire import PROTOCOL_VERSION, Description, EndpointInfo
from ._canary import EndpointCanary
from ._config import RuntimeConfig
from ._endpoints import ServedEndpoints
from ._lease import Lease
from ._naming import Endpoint, Namespace, check_name
from ._peers import PeerPool
from ._registrations import Registrations

__all__ = ["DistributedRuntime"]

log = logging.getLogger(__name__)

#: Seconds ``hand_over`` waits for the handed-over requests' terminals to go out.
HAND_OVER_FLUSH = 2.0


class DistributedRuntime:
    """The per-process runtime: one request-plane socket, discovery, and peer connections.

    Accepts Dynamo's constructor arguments ``(event_loop, discovery_backend, request_plane,
    enable_nats)``; ``discovery_backend`` may be ``"mdns"`` or ``"static"`` (Dynamo's etcd /
    kubernetes / file backends need infrastructure this project replaces, so they fall back to
    the configured default). Pass ``config=`` for full control.

    ``resources`` (default: a new one) owns every task and socket the runtime starts; the
    process's other components hang theirs under it (``runtime.resources.child(name)``), so
    ``close()`` ends them all, in order.
    """

    def __init__(
        self,
        event_loop: asyncio.AbstractEventLoop | None = None,
        discovery_backend: str | None = None,
        request_plane: str | None = None,
        enable_nats: bool | None = None,
        *,
        config: RuntimeConfig | None = None,
        resources: Resources | None = None,
    ) -> None:
        if config is None:
            config = RuntimeConfig.from_env()
            if discovery_backend in ("mdns", "static"):
                disc = dataclasses.replace(config.discovery, backend=discovery_backend)
                config = dataclasses.replace(config, discovery=disc)
            elif discovery_backend is not None:
                log.info("discovery backend %r maps to %r here",
                         discovery_backend, config.discovery.backend)
        self.config = config
        self.instance_id = secrets.randbits(63) or 1
        self.started_at = time.time()
        self.metadata: dict[str, Any] = {}
        #: Where the request plane is advertised (read once, when it is bound).
        self._hosts: tuple[str, ...] = ()
        self.resources = resources if resources is not None else Resources("runtime")
        #: CURVE on every socket of the process (``--auth-keys``); before any socket is made.
        self._curve = (
            enable_curve(config.auth_keys, config.auth_key_name, self.resources.zctx)
            if config.auth_keys else None
        )
        self._discovery: Discovery = make_discovery(config.discovery)
        self._discovery_started = False
        self._server: Server | None = None
        #: The served endpoints: handlers, callers, health verdicts, metadata.
        self._endpoints = ServedEndpoints()
        self._canaries: dict[str, asyncio.Task[None]] = {}
        self._peers: PeerPool | None = None
        self._shutdown = asyncio.Event()
        self._closed = False
        self._lock = asyncio.Lock()
        self._lease = Lease(self.instance_id)
        self._lease.add_listener(self._on_lease_lost)
        self._registrations = Registrations(
            self._discovery, self._lease, self.resources, self._ensure_discovery
        )

    # -- naming ----------------------------------------------------------------------------

    def namespace(self, name: str) -> Namespace:
        return Namespace(self, check_name(name, "namespace"))

    def endpoint(self, path: str) -> Endpoint:
        """``"ns.component.endpoint"`` (or ``"dyn://ns.component.endpoint"``)."""
        parts = path.removeprefix("dyn://").split(".")
        if len(parts) != 3:
            raise errors.InvalidArgument(
                f"endpoint path {path!r} is not namespace.component.endpoint"
            )
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
                server = Server(
                    self.resources, bind, self.instance_id, self._endpoints.handlers.get,
                    self.describe, self._endpoints.callers,
                )
                server.kill_grace = self.config.kill_grace
                await server.start()
                self._hosts = self.config.advertised_hosts()
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
            endpoints=self._endpoints.listed(),
            draining=self._server.draining if self._server else False,
            metadata=self.metadata,
            hosts=list(self._hosts),
        )

    async def create_service(self) -> None:
        """Bind the request-plane socket if it is not bound yet (``Component.create_service``)."""
        await self._ensure_server()

    async def add_endpoint(
        self, info: EndpointInfo, handler: TransportHandler,
        callers: frozenset[str] = DEFAULT_CALLERS,
    ) -> None:
        """Serve ``handler`` as ``info.path`` and advertise it (``Endpoint.start_serving``);
        with auth on, only keys holding one of ``callers`` (key roles) may call it.

        Raises:
            EngineShutdown: the runtime's lease was lost; it registers nothing new.
        """
        if not self._lease.is_valid():
            raise errors.EngineShutdown(
                f"cannot serve {info.path}: the lease {self.instance_id:x} was lost "
                f"({self._lease.reason})"
            )
        server = await self._ensure_server()
        self._endpoints.add(info, handler, callers)
        server.bump_rev()
        await self._advertise(info.namespace)

    async def remove_endpoint(self, path: str) -> None:
        """Stop serving ``path``; withdraw the advert when it was the last of its namespace."""
        info = self._endpoints.remove(path)
        canary = self._canaries.pop(path, None)
        if canary is not None:
            await cancel_and_wait((canary,))
        if info is None or self._server is None:
            return
        self._server.bump_rev()
        if self._endpoints.serves_namespace(info.namespace):
            await self._advertise(info.namespace)
        else:
            await self._registrations.withdraw(info.namespace)

    def set_endpoint_health(self, path: str, healthy: bool) -> None:
        """Whether callers may route new work to endpoint ``path`` (its health check's verdict).

        An unhealthy endpoint is still served (requests already on their way are answered) but
        is left out of the description, so every caller's client, under mDNS or static
        discovery alike, stops choosing this instance for it at the next NOTICE or PONG; a
        healthy verdict lists it again. No-op for a path not served here.
        """
        if not self._endpoints.set_health(path, healthy):
            return
        log.log(logging.INFO if healthy else logging.WARNING, "endpoint %s is %s", path,
                "healthy again: routable" if healthy else "unhealthy: withdrawn from routing")
        if self._server is not None:
            self._server.bump_rev()

    def set_endpoint_metadata(self, path: str, metadata: dict[str, Any]) -> None:
        """Replace endpoint ``path``'s metadata (a worker's model advert after a LoRA load) and
        tell connected clients, which fetch the new description. No-op for a path not served."""
        if self._endpoints.set_metadata(path, metadata) and self._server is not None:
            self._server.bump_rev()

    def watch_health(
        self, path: str, handler: TransportHandler, payload: object
    ) -> TransportHandler:
        """Check endpoint ``path``'s health with ``payload`` sent to its own ``handler`` when it
        is idle (``runtime/_canary.py``); returns the handler to serve. Without canaries
        (``DYN_HEALTH_CHECK_ENABLED=false``) returns ``handler`` as it is."""
        old = self._canaries.pop(path, None)
        if old is not None:
            old.cancel()  # the endpoint is served again: its new handler gets the canary
        if not self.config.canary.enabled:
            return handler
        canary = EndpointCanary(self, path, handler, payload, self.config.canary)
        self._canaries[path] = self.resources.spawn(canary.run(), f"canary-{path}")
        return canary.watch()

    async def _advertise(self, namespace: str) -> None:
        assert self._server is not None
        if not self._lease.is_valid():
            return  # registrations die with the lease
        port = self._server.address.rsplit(":", 1)[1]
        components = self._endpoints.components(namespace)
        advert = Advert(
            namespace=namespace,
            instance_id=self.instance_id,
            addresses=tuple(f"tcp://{h}:{port}" for h in self._hosts),
            components=components,
            public_key=self._curve.public.decode() if self._curve is not None else "",
        )
        await self._registrations.advertise(advert)

    # -- the lease -------------------------------------------------------------------------

    def primary_lease(self) -> Lease:
        """The runtime's primary lease: ``id()`` (the instance id), ``is_valid()``,
        ``revoke()``. Revoking it, or losing a registration that cannot be renewed, withdraws
        every advert and shuts the runtime down (``wait_shutdown`` returns)."""
        return self._lease

    def lease_id(self) -> int:
        """The primary lease id: the instance id in every registration (Dynamo's name)."""
        return self._lease.id()

    def _on_lease_lost(self, reason: str) -> None:
        """What etcd does when a lease ends: the registrations vanish, then the runtime stops."""
        self.shutdown()
        if self._closed or self.resources.closed:
            return
        if self._server is not None:
            self._server.set_draining()  # connected clients route elsewhere at once
        self.resources.spawn(self._registrations.withdraw_all(), "lease-lost")

    # -- calling ---------------------------------------------------------------------------

    async def peer_pool(self, namespace: str | None) -> PeerPool:
        """The peer connections, watching ``namespace`` too (None: every namespace)."""
        if self._peers is None:
            await self._ensure_discovery()
            self._peers = PeerPool(self.resources, self._discovery)
        self._peers.watch(namespace)
        return self._peers

    async def peers(self, namespace: str | None = None) -> list[PeerConnection]:
        """Connections to every discovered process (``None``: all namespaces)."""
        pool = await self.peer_pool(namespace)
        return list(pool.peers.values())

    async def wait_peers_changed(
        self, timeout: float | None = None, since: int | None = None
    ) -> int:
        """Wait until any discovered peer changes (or ``timeout``); ``since``: a generation
        this returned before, so a change made meanwhile returns at once. Returns the
        generation now."""
        pool = await self.peer_pool(None) if self._peers is None else self._peers
        return await pool.wait_changed(timeout, since)

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
        await self.stop_admitting()
        return await self.wait_idle(timeout)

    async def stop_admitting(self) -> None:
        """The first half of ``drain``: withdraw the adverts and tell connected clients to route
        elsewhere, wait the grace period, then refuse new requests (``EngineShutdown``).
        In-flight requests keep running."""
        await self._registrations.withdraw_all()
        if self._server is None:
            return
        self._server.set_draining()
        await asyncio.sleep(self.config.grace_period)
        self._server.refuse_new()

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """The second half of ``drain``: wait until no request is in flight, at most ``timeout``
        seconds (default: the graceful timeout). Returns False if some still run."""
        if self._server is None:
            return True
        return await self._server.wait_idle(
            self.config.graceful_timeout if timeout is None else timeout
        )

    async def hand_over(self, reason: str, timeout: float = HAND_OVER_FLUSH) -> int:
        """End every request still in flight with a retryable ``EngineShutdown(reason)`` after
        the outputs it already sent (its caller moves it to another instance), refuse new
        ones, and wait up to ``timeout`` seconds for those terminals to go out. Returns how
        many requests were handed over."""
        if self._server is None:
            return 0
        handed = self._server.hand_over(reason)
        if not await self._server.wait_idle(timeout):
            log.warning("%d requests still open %gs after the hand-over",
                        self._server.inflight, timeout)
        return handed

    @property
    def inflight(self) -> int:
        """Requests this process is serving now."""
        return 0 if self._server is None else self._server.inflight

    async def close(self) -> None:
        """Withdraw adverts, close the server, peers and discovery (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._shutdown.set()
        await self._registrations.withdraw_all()
        if self._server is not None:
            await self._server.close()
        if self._peers is not None:
            await self._peers.close()
        await self._discovery.close()
        await self.resources.close()  # whatever else was started under the runtime

    async def __aenter__(self) -> DistributedRuntime:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


