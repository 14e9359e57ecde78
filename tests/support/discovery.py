"""Helpers for discovery tests: fresh namespaces and instance ids, so parallel runs on one
host never see each other's adverts, and a bounded wait for a watch's next event."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

from dynamo_zmq.discovery import DiscoveryEvent

__all__ = ["WAIT", "next_event", "unique_iid", "unique_ns"]

#: Generous bound for one event; mDNS on loopback normally takes milliseconds.
WAIT = 10.0


def unique_ns() -> str:
    """A namespace no other test (or test run) uses."""
    return f"t-{uuid.uuid4().hex[:10]}"


def unique_iid() -> int:
    """A random 64-bit instance id."""
    return uuid.uuid4().int & (2**64 - 1)


async def next_event(it: AsyncIterator[DiscoveryEvent]) -> DiscoveryEvent:
    """The next event of a watch; fails the test if none comes within ``WAIT`` seconds."""
    return await asyncio.wait_for(anext(it), WAIT)
