"""What a response stream offers its reader (``ItemStream``) and needs of the connection its
request went out on (``StreamHost``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, TypeVar

import msgspec

from ..context import Context

__all__ = ["MAX_BATCH_ITEMS", "ItemStream", "StreamHost"]

T = TypeVar("T")

#: Most items ``next_batch`` returns at once (one DATA frame holds at most 256).
MAX_BATCH_ITEMS = 256


class ItemStream(Protocol[T]):
    """A request's response items: iterate them, or take what has arrived in batches."""

    @property
    def context(self) -> Context: ...

    @property
    def instance_id(self) -> int:
        """The instance serving the request now."""
        ...

    def __aiter__(self) -> AsyncIterator[T]: ...

    async def __anext__(self) -> T: ...

    async def next_batch(self, max_items: int = MAX_BATCH_ITEMS) -> list[T]:
        """Wait for at least one item and return every item that has arrived (up to
        ``max_items``); an empty list once the stream has ended. Errors raise as from
        ``__anext__``."""
        ...

    async def aclose(self) -> None: ...

    def set_stall_timeout(self, seconds: float | None) -> None:
        """End the stream with ``StreamStalled`` when nothing arrives for ``seconds`` while
        its reader waits (see ``ResponseStream``); None: never."""
        ...


class StreamHost(Protocol):
    """What a stream needs of the connection its request went out on (``PeerConnection``)."""

    @property
    def instance_id(self) -> int: ...

    def send_control(self, kind: bytes, msg: msgspec.Struct) -> None:
        """Send STOP, KILL or CREDIT for a stream, without waiting."""
        ...

    def forget_stream(self, request_id: int) -> None:
        """Stop tracking the stream ``request_id`` (its caller is done with it)."""
        ...

    def serves(self, endpoint: str) -> bool:
        """Whether the instance still offers ``endpoint`` (its health check passes)."""
        ...
