"""Waits on the transport's events never swallow a cancellation that comes as the event is set.

``asyncio.wait_for(event.wait(), t)`` on Python 3.11 returns instead of raising when its task is
cancelled in the loop iteration that sets the event, so a loop around it runs on after its
owner cancelled it. These waits use ``resources.wait_event`` (or ``asyncio.timeout``) instead:
``PeerConnection.wait_described``, ``Server.wait_idle``, a response stream's wait for its next
item (``transport/_streams.py``) and the health canary's probe (``runtime/_canary.py``), the
four sites issue 33 names. Each race is made deterministic; each test fails with ``wait_for``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from dynamo_zmq.resources import Resources
from dynamo_zmq.runtime._canary import CanaryConfig, EndpointCanary
from dynamo_zmq.transport import PeerConnection, plain_items
from dynamo_zmq.wire import encode_item


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


async def test_a_streams_idle_wait_keeps_a_cancellation_that_comes_with_an_item(
        make_runtime, namespace: str) -> None:
    """The wait for a stream's next item (with an idle timeout) is cancelled in the turn its
    item arrives: the reader must see the cancellation, not the item."""
    release = asyncio.Event()

    async def hold(request: dict[str, Any]):
        await release.wait()
        yield {"done": True}

    srv = make_runtime(static=())
    await srv.endpoint(f"{namespace}.w.hold").start_serving(hold)
    res = Resources("test")
    conn = PeerConnection(res, srv.address)
    conn.start()
    try:
        await conn.wait_described(10)
        stream = await conn.open_stream(f"{namespace}.w.hold", encode_item({}),
                                        decode=plain_items, idle_timeout=30)
        reading = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.05)
        assert not reading.done()
        stream._st.items.append({"early": True})  # as a DATA frame's dispatch does
        stream._st.waiter.set()
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
    finally:
        release.set()
        await conn.close()
        await res.close()


async def test_a_canary_probe_keeps_a_cancellation_that_comes_with_the_answer(
        make_runtime, namespace: str) -> None:
    """The canary's owner cancels it in the turn the probed handler answers: the probe must
    end cancelled (its loop would otherwise run on), not report a verdict."""
    probing: asyncio.Future[bool] | None = None

    async def answers_as_cancelled(payload: Any, ctx: Any):
        assert probing is not None
        probing.cancel()
        yield {"ok": True}

    runtime = make_runtime(static=())
    canary = EndpointCanary(runtime, f"{namespace}.w.generate", answers_as_cancelled, {},
                            CanaryConfig())
    probing = asyncio.ensure_future(canary.probe())
    with pytest.raises(asyncio.CancelledError):
        await probing
