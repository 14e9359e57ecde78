"""A response stream dropped unread on another thread is released on its loop's thread.

The release sends KILL on the connection's ZMQ socket and runs the owner's ``on_release`` (the
frontend's router decrements its load there): both belong to the event loop's thread, whichever
thread the garbage collector happens to run on.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest

from dynamo_zmq.resources import Resources
from dynamo_zmq.transport import PeerConnection, plain_items
from dynamo_zmq.wire import encode_item


@pytest.fixture
async def endless(make_runtime, namespace: str) -> AsyncIterator[dict[str, Any]]:
    """A runtime whose endpoint streams until cancelled, and a connection to it."""
    path = f"{namespace}.worker.endless"
    state: dict[str, Any] = {"path": path, "cancelled": asyncio.Event()}

    async def endless_items(request: dict[str, Any]):
        try:
            while True:
                yield {"tick": True}
                await asyncio.sleep(0.01)
        except (asyncio.CancelledError, GeneratorExit):
            state["cancelled"].set()
            raise

    srv = make_runtime(static=())
    await srv.endpoint(path).start_serving(endless_items)
    res = Resources("test")
    conn = PeerConnection(res, srv.address)
    conn.start()
    try:
        await conn.wait_described(10)
        state["conn"] = conn
        yield state
    finally:
        await conn.close()
        await res.close()


async def test_a_stream_dropped_on_another_thread_is_released_on_the_loop(
        endless: dict[str, Any]) -> None:
    conn: PeerConnection = endless["conn"]
    stream = await conn.open_stream(endless["path"], encode_item({}), decode=plain_items)
    assert await anext(stream) == {"tick": True}
    released = asyncio.Event()
    threads: list[int] = []
    loop = asyncio.get_running_loop()

    def on_release() -> None:
        threads.append(threading.get_ident())
        loop.call_soon_threadsafe(released.set)

    stream.set_on_release(on_release)
    holder = [stream]
    del stream
    await asyncio.to_thread(holder.clear)  # the last reference goes on a worker thread
    await asyncio.wait_for(released.wait(), 10)
    assert threads == [threading.get_ident()]
    await asyncio.wait_for(endless["cancelled"].wait(), 10)  # and the KILL reached the server
