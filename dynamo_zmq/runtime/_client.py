"""``Client``: calls the live instances of one endpoint, with routing and failover."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Callable
from typing import Any

import msgspec

from .. import errors
from ..context import Context
from ..transport import PeerConnection, ResponseStream
from ..wire import encode_item
from ._peers import PeerPool
from ._retry import RetryingStream

__all__ = ["Client", "RouterMode"]


class RouterMode:
    """How ``Client.generate`` picks an instance (Dynamo's names)."""

    RoundRobin = "round_robin"
    Random = "random"
    Direct = "direct"


Picker = Callable[[list[PeerConnection]], list[PeerConnection]]


class Client:
    """Calls the live instances of one endpoint; picks by round-robin, random, or directly.

    A request that fails with a retryable error (the instance died, or started shutting down)
    before any response arrived is sent again to another instance, up to ``MAX_ATTEMPTS`` in
    all; ``direct`` calls are never moved.
    """

    def __init__(
        self,
        path: str,
        pool: PeerPool,
        router_mode: str = RouterMode.RoundRobin,
        select: Callable[[PeerConnection], bool] | None = None,
    ) -> None:
        if router_mode not in (RouterMode.RoundRobin, RouterMode.Random, RouterMode.Direct):
            raise errors.InvalidArgument(f"unknown router mode {router_mode!r}")
        self.path = path
        self._pool = pool
        self._mode = router_mode
        self._select = select
        self._rr = itertools.count()

    def instances(self) -> list[PeerConnection]:
        """Connections to the instances able to take work now (narrowed by ``select``)."""
        conns = self._pool.instances(self.path)
        return conns if self._select is None else [c for c in conns if self._select(c)]

    def instance_ids(self) -> list[int]:
        """Ids of the instances currently able to take work, sorted."""
        return [c.instance_id for c in self.instances()]

    async def wait_for_instances(self, timeout: float | None = None) -> list[int]:
        """Wait until at least one instance is live; raises ConnectionTimeout after ``timeout``."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not (ids := self.instance_ids()):
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                raise errors.ConnectionTimeout(f"no instance of {self.path} within {timeout}s")
            await self._pool.wait_changed(min(remaining, 1.0) if remaining is not None else 1.0)
        return ids

    async def generate(
        self, request: Any, annotated: bool = True, context: Context | None = None, **kwargs: Any
    ) -> Any:
        """Send with the client's router mode (``direct`` mode needs ``instance_id=``)."""
        if self._mode == RouterMode.Direct:
            instance_id = kwargs.pop("instance_id", None)
            if instance_id is None:
                raise errors.InvalidArgument("a direct-mode client needs instance_id= (or use direct())")
            return await self.direct(request, instance_id, context=context, annotated=annotated, **kwargs)
        if self._mode == RouterMode.Random:
            return await self.random(request, context=context, annotated=annotated, **kwargs)
        return await self.round_robin(request, context=context, annotated=annotated, **kwargs)

    async def round_robin(self, request: Any, context: Context | None = None, **kwargs: Any) -> Any:
        def pick(conns: list[PeerConnection]) -> list[PeerConnection]:
            start = next(self._rr) % len(conns)
            return conns[start:] + conns[:start]

        return await self._send(request, pick, context, failover=True, **kwargs)

    async def random(self, request: Any, context: Context | None = None, **kwargs: Any) -> Any:
        def pick(conns: list[PeerConnection]) -> list[PeerConnection]:
            return random.sample(conns, len(conns))

        return await self._send(request, pick, context, failover=True, **kwargs)

    async def direct(
        self, request: Any, instance_id: int | str, context: Context | None = None, **kwargs: Any
    ) -> Any:
        """Send to exactly ``instance_id`` (int, or hex string); CannotConnect if it is not live."""
        target = int(instance_id, 16) if isinstance(instance_id, str) else int(instance_id)

        def pick(conns: list[PeerConnection]) -> list[PeerConnection]:
            chosen = [c for c in conns if c.instance_id == target]
            if not chosen:
                raise errors.CannotConnect(f"instance {target:x} of {self.path} is not live")
            return chosen

        return await self._send(request, pick, context, failover=False, **kwargs)

    async def _send(
        self,
        request: Any,
        pick: Picker,
        context: Context | None,
        failover: bool,
        **options: Any,
    ) -> Any:
        payload = encode_item(request)
        stream = await self._open(payload, pick, context, exclude=set(), **options)
        if not failover:
            return stream
        return FailoverStream(self, stream, payload, pick, options)

    async def _open(
        self,
        payload: msgspec.Raw,
        pick: Picker,
        context: Context | None,
        exclude: set[int],
        annotated: bool = True,
        timeout: float | None = None,
        idle_timeout: float | None = None,
    ) -> ResponseStream:
        conns = [c for c in self.instances() if c.instance_id not in exclude]
        if not conns:
            raise errors.CannotConnect(f"no live instance of {self.path}")
        last: errors.DynamoError | None = None
        # An instance can die between the pick and the send: try the next candidate.
        for conn in pick(conns):
            try:
                return await conn.open_stream(
                    self.path,
                    payload,
                    context,
                    annotated=annotated,
                    timeout=timeout,
                    idle_timeout=idle_timeout,
                )
            except errors.CannotConnect as exc:
                last = exc
        assert last is not None
        raise last


class FailoverStream(RetryingStream):
    """A response stream that moves to another instance if the first fails before responding."""

    def __init__(
        self,
        client: Client,
        stream: ResponseStream,
        payload: msgspec.Raw,
        pick: Picker,
        options: dict[str, Any],
    ) -> None:
        super().__init__(stream)
        self._client = client
        self._payload = payload
        self._pick = pick
        self._options = options

    async def _reopen(self) -> ResponseStream | None:
        try:
            return await self._client._open(
                self._payload, self._pick, self._stream.context, self._tried, **self._options
            )
        except errors.CannotConnect:
            return None
