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
remote process. Discovery (mDNS or a static list) and liveness replace etcd and NATS.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import socket
import time
from typing import Any

from .. import errors
from ..discovery import Advert, Discovery, make_discovery
from ..resources import Resources
from ..transport import Handler as TransportHandler
from ..transport import PeerConnection, Server
from ..wire import PROTOCOL_VERSION, Description, EndpointInfo
from ._config import RuntimeConfig
from ._naming import Endpoint, Namespace, check_name
from ._peers import PeerPool

__all__ = ["DistributedRuntime"]

log = logging.getLogger(__name__)


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
        self.resources = resources if resources is not None else Resources("runtime")
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
                    self.resources, bind, self.instance_id, self._handlers.get, self.describe
                )
                server.kill_grace = self.config.kill_grace
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

    async def create_service(self) -> None:
        """Bind the request-plane socket if it is not bound yet (``Component.create_service``)."""
        await self._ensure_server()

    async def add_endpoint(self, info: EndpointInfo, handler: TransportHandler) -> None:
        """Serve ``handler`` as ``info.path`` and advertise it (``Endpoint.start_serving``)."""
        server = await self._ensure_server()
        self._handlers[info.path] = handler
        self._endpoint_info[info.path] = info
        server.bump_rev()
        await self._advertise(info.namespace)

    async def remove_endpoint(self, path: str) -> None:
        """Stop serving ``path``; withdraw the advert when it was the last of its namespace."""
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

    async def wait_peers_changed(self, timeout: float | None = None) -> None:
        """Wait until any discovered peer changes (or ``timeout``)."""
        pool = await self.peer_pool(None) if self._peers is None else self._peers
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
        return await self._server.wait_idle(
            self.config.graceful_timeout if timeout is None else timeout
        )

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
        await self.resources.close()  # whatever else was started under the runtime

    async def __aenter__(self) -> DistributedRuntime:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


