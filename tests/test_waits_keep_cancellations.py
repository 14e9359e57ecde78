"""Waits on the transport's events never swallow a cancellation that comes as the event is set.

``asyncio.wait_for(event.wait(), t)`` on Python 3.11 returns instead of raising when its task is
cancelled in the loop iteration that sets the event, so a loop around it runs on after its
owner cancelled it. These waits use ``resources.wait_event`` (or ``asyncio.timeout``) instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from dynamo_zmq.resources import Resources
from dynamo_zmq.transport import PeerConnection


async def _cancelled_as_set(event: asyncio.Event, wait: Any) -> None:
    waiting = asyncio.ensure_future(wait)
    await asyncio.sleep(0.05)
    assert not waiting.done()
    event.set()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def test_wait_described_keeps_a_cancellation_that_comes_with_the_answer() -> None:
    res = Resources("test")
    # Nobody listens there: the DESCRIBE answer is the event the test sets itself.
    conn = PeerConnection(res, "tcp://127.0.0.1:9")
    conn.start()
    try:
        await _cancelled_as_set(conn._described, conn.wait_described(30))
    finally:
        await conn.close()
        await res.close()


@pytest.fixture
async def busy_server(make_runtime, namespace: str) -> AsyncIterator[Any]:
    release = asyncio.Event()

    async def hold(request: dict[str, Any]):
        await release.wait()
        yield {"done": True}

    srv = make_runtime(static=())
    await srv.endpoint(f"{namespace}.w.hold").start_serving(hold)
    yield srv._server
    release.set()


async def test_wait_idle_keeps_a_cancellation_that_comes_as_the_server_goes_idle(
        busy_server: Any) -> None:
    busy_server._idle.clear()  # as an open stream leaves it
    await _cancelled_as_set(busy_server._idle, busy_server.wait_idle(30))
