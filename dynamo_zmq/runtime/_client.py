"""``Client``: calls the live instances of one endpoint, with routing and failover."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from .. import errors
from ..context import Context
from ..tracing import span
from ..transport import (
    ItemDecoder,
    ItemStream,
    PeerConnection,
    PeerState,
    ResponseStream,
    plain_items,
    response_items,
)
from ..transport import item_decoder as typed_decoder
from ..wire import encode_item
from . import _retry
from ._peers import PeerPool

__all__ = ["Client", "RouterMode"]

T = TypeVar("T")


class RouterMode:
    """How ``Client.generate`` picks an instance (Dynamo's names)."""

    RoundRobin = "round_robin"
    Random = "random"
    Direct = "direct"


Picker = Callable[[list[PeerConnection]], list[PeerConnection]]
"""Orders the candidate instances of one attempt (the first that accepts the request wins)."""


class Client:
    """Calls the live instances of one endpoint; picks by round-robin, random, or directly.

    A request that fails with a retryable error (the instance died, or started shutting down)
    before any response arrived is sent again to another instance, up to ``MAX_ATTEMPTS`` in
    all; ``direct`` calls are never moved.

    Dynamo's methods (``generate``, ``round_robin``, ``random``, ``direct``) yield ``Response``
    items (``annotated=True``) or plain decoded values; ``stream`` yields items validated into
    a given type, and ``open`` is one attempt on one chosen instance, for routers.
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
        self.mode = router_mode
        self._pool = pool
        self._select = select
        #: (pool generation, live instances, instances to route to) as of that generation.
        self._selected: tuple[int, list[PeerConnection], list[PeerConnection]] | None = None
        self._rr = itertools.count()

    @property
    def generation(self) -> int:
        """Bumped by every change of the instances (their pool's generation)."""
        return self._pool.generation

    def instances(self, *, silent: bool = False) -> list[PeerConnection]:
        """Connections to the instances able to take work now (narrowed by ``select``, once
        per change of the pool). An instance that left a ping unanswered (SILENT: frozen, or
        its loop stuck) is left out while another one answers; ``silent``: include those
        (state that should outlive a moment's silence, e.g. a KV router's index of it)."""
        gen = self._pool.generation
        if self._selected is None or self._selected[0] != gen:
            conns = self._pool.instances(self.path)
            if self._select is not None:
                conns = [c for c in conns if self._select(c)]
            answering = [c for c in conns if c.state is PeerState.READY]
            self._selected = (gen, conns, answering or conns)
        return list(self._selected[1] if silent else self._selected[2])

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

    # -- Dynamo's API ----------------------------------------------------------------------

    async def generate(
        self,
        request: object,
        annotated: bool = True,
        context: Context | None = None,
        *,
        instance_id: int | str | None = None,
        timeout: float | None = None,
        idle_timeout: float | None = None,
    ) -> ItemStream[Any]:
        """Send with the client's router mode (``direct`` mode needs ``instance_id=``)."""
        if self.mode == RouterMode.Direct and instance_id is None:
            raise errors.InvalidArgument(
                "a direct-mode client needs instance_id= (or use direct())"
            )
        return await self._call(
            request, _plain(annotated), context, instance_id, timeout, idle_timeout
        )

    async def round_robin(
        self,
        request: object,
        context: Context | None = None,
        annotated: bool = True,
        **options: Any,
    ) -> ItemStream[Any]:
        return await self._send(request, self._round_robin, _plain(annotated), context, **options)

    async def random(
        self,
        request: object,
        context: Context | None = None,
        annotated: bool = True,
        **options: Any,
    ) -> ItemStream[Any]:
        return await self._send(request, _shuffled, _plain(annotated), context, **options)

    async def direct(
        self,
        request: object,
        instance_id: int | str,
        context: Context | None = None,
        annotated: bool = True,
        **options: Any,
    ) -> ItemStream[Any]:
        """Send to exactly ``instance_id`` (int, or hex string); CannotConnect if it is not live."""
        pick = self._only(instance_id)
        return await self._send(
            request, pick, _plain(annotated), context, failover=False, **options
        )

    # -- typed -----------------------------------------------------------------------------

    async def stream(
        self,
        request: object,
        item_type: type[T],
        *,
        context: Context | None = None,
        instance_id: int | None = None,
        timeout: float | None = None,
        idle_timeout: float | None = None,
        exclude: frozenset[int] = frozenset(),
        only: frozenset[int] | None = None,
    ) -> ItemStream[T]:
        """Like ``generate``, with items decoded and validated into ``item_type`` (a response
        that does not fit fails the stream with ``errors.Unknown``). ``exclude``: instances
        not to send to (nor fail over to), e.g. those a migrated request was lost on;
        ``only``: the only instances it may go to, failover included (None: any)."""
        return await self._call(
            request, typed_decoder(item_type), context, instance_id, timeout, idle_timeout,
            exclude, only,
        )

    async def open(
        self,
        payload: msgspec.Raw,
        decode: ItemDecoder[T],
        instance_id: int,
        *,
        context: Context | None = None,
        timeout: float | None = None,
        idle_timeout: float | None = None,
        trace_attributes: dict[str, Any] | None = None,
    ) -> ResponseStream[T]:
        """One attempt: send the encoded request to exactly ``instance_id``, no failover.
        ``trace_attributes``: added to the ``route`` span (with tracing on), e.g. a KV router's
        ``overlap_blocks``.

        Raises:
            CannotConnect: the instance is not live (or its send failed).
        """
        return await self._open(
            payload, self._only(instance_id), decode, context, frozenset(), timeout, idle_timeout,
            trace_attributes,
        )

    # -- sending ---------------------------------------------------------------------------

    async def _call(
        self,
        request: object,
        decode: ItemDecoder[T],
        context: Context | None,
        instance_id: int | str | None,
        timeout: float | None,
        idle_timeout: float | None,
        exclude: frozenset[int] = frozenset(),
        only: frozenset[int] | None = None,
    ) -> ItemStream[T]:
        if instance_id is not None:
            pick, failover = self._only(instance_id), False
        elif self.mode == RouterMode.Random:
            pick, failover = _shuffled, True
        else:
            pick, failover = self._round_robin, True
        if only is not None:
            pick = _among(only, pick, self.path)
        return await self._send(
            request, pick, decode, context, failover=failover, timeout=timeout,
            idle_timeout=idle_timeout, exclude=exclude,
        )

    async def _send(
        self,
        request: object,
        pick: Picker,
        decode: ItemDecoder[T],
        context: Context | None,
        failover: bool = True,
        timeout: float | None = None,
        idle_timeout: float | None = None,
        exclude: frozenset[int] = frozenset(),
    ) -> ItemStream[T]:
        payload = encode_item(request)
        first = await self._open(payload, pick, decode, context, exclude, timeout, idle_timeout)
        if not failover:
            return first
        ctx = first.context  # not ``first``: the hook must not keep the stream alive

        async def reopen(tried: frozenset[int]) -> ResponseStream[T] | None:
            try:
                return await self._open(payload, pick, decode, ctx, tried, timeout, idle_timeout)
            except errors.CannotConnect:
                return None

        return _retry.failover(first, reopen, exclude)

    async def _open(
        self,
        payload: msgspec.Raw,
        pick: Picker,
        decode: ItemDecoder[T],
        context: Context | None,
        exclude: frozenset[int],
        timeout: float | None,
        idle_timeout: float | None,
        trace_attributes: dict[str, Any] | None = None,
    ) -> ResponseStream[T]:
        conns = [c for c in self.instances() if c.instance_id not in exclude]
        if not conns:
            raise errors.CannotConnect(f"no live instance of {self.path}")
        last: errors.DynamoError | None = None
        # An instance can die between the pick and the send: try the next candidate.
        for conn in pick(conns):
            try:
                # The routing decision's span: the request's trace context goes out under it.
                with span("route", endpoint=self.path, worker_id=f"{conn.instance_id:x}",
                          **(trace_attributes or {})):
                    return await conn.open_stream(
                        self.path, payload, context, decode=decode, timeout=timeout,
                        idle_timeout=idle_timeout,
                    )
            except errors.CannotConnect as exc:
                last = exc
        assert last is not None
        raise last

    def _round_robin(self, conns: list[PeerConnection]) -> list[PeerConnection]:
        start = next(self._rr) % len(conns)
        return conns[start:] + conns[:start]

    def _only(self, instance_id: int | str) -> Picker:
        target = int(instance_id, 16) if isinstance(instance_id, str) else int(instance_id)

        def pick(conns: list[PeerConnection]) -> list[PeerConnection]:
            chosen = [c for c in conns if c.instance_id == target]
            if not chosen:
                raise errors.CannotConnect(f"instance {target:x} of {self.path} is not live")
            return chosen

        return pick


def _among(only: frozenset[int], pick: Picker, path: str) -> Picker:
    """``pick`` narrowed to the instances in ``only`` (CannotConnect when none is live)."""

    def narrowed(conns: list[PeerConnection]) -> list[PeerConnection]:
        allowed = [c for c in conns if c.instance_id in only]
        if not allowed:
            raise errors.CannotConnect(f"no live instance of {path} among those allowed")
        return pick(allowed)

    return narrowed


def _shuffled(conns: list[PeerConnection]) -> list[PeerConnection]:
    return random.sample(conns, len(conns))


def _plain(annotated: bool) -> ItemDecoder[Any]:
    """Dynamo's item forms: ``Response`` (decoded on ``data()``) or the decoded value."""
    return response_items if annotated else plain_items
