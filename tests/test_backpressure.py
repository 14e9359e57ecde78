"""Credit flow control: a slow reader slows the producer instead of growing anybody's memory.

Without credit the server would encode a whole long stream at once and the client's receive
loop would queue all of it; with credit, at most one window of items is ever in flight.

Checked when this was written: the same slow read with a window of 10**9 queued 19,996 items and
grew the client by 31 MB (the bound here is ~7.7 MB), while the server stayed flat, since the
client drains its socket eagerly. So the client's memory and queue are the sharp checks; the
server's RSS is checked too, for a server that would buffer instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import psutil
import pytest

from dynamo_zmq.resources import Resources
from dynamo_zmq.transport import PeerConnection, ResponseStream, plain_items
from dynamo_zmq.transport.client import DEFAULT_WINDOW
from dynamo_zmq.wire import encode_item
from tests.conftest import app_args

N_ITEMS = 20_000
PAD = 1500  # characters of padding per item: each item is ~1.5 KB on the wire
SLOW_PHASE = 6.0  # seconds of slow reading
SLOW_READ_PAUSE = 0.005


async def eventually(condition: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.005)


def rss(proc: psutil.Process) -> int:
    return proc.memory_info().rss


def queued(stream: Any) -> int:
    """Items received but not yet read: the length of the transport stream's private queue."""
    inner = getattr(stream, "_stream", stream)  # the runtime's client may wrap it (failover)
    return len(inner._st.items)


async def test_a_slow_reader_keeps_both_sides_memory_bounded(
    namespace, spawn, make_runtime
) -> None:
    server = spawn(*app_args(namespace, "--discovery", "static"))
    rt = make_runtime(static=(server.address,))
    client = await rt.endpoint(f"{namespace}.backend.count").client()
    await client.wait_for_instances(timeout=15)

    item_bytes = len(encode_item({"i": N_ITEMS, "instance": server.instance_id, "pad": "x" * PAD}))
    stream_bytes = N_ITEMS * item_bytes  # ~30 MB: what buffering the whole stream would hold
    bound = stream_bytes // 4
    window_bytes = DEFAULT_WINDOW * item_bytes  # what credit allows in flight (~1.5 MB)
    assert window_bytes * 3 < bound  # the bound leaves room for one window plus noise

    # Warm both processes up with a stream of the same items (imports, allocator arenas).
    warm = [
        r.data()["i"]
        async for r in await client.generate({"n": 2 * DEFAULT_WINDOW, "pad": PAD})
    ]
    assert warm == list(range(2 * DEFAULT_WINDOW))
    server_proc, client_proc = psutil.Process(server.pid), psutil.Process()
    server_base, client_base = rss(server_proc), rss(client_proc)
    server_peak, client_peak, most_queued = server_base, client_base, 0

    stream = await client.generate({"n": N_ITEMS, "pad": PAD})
    seen: list[int] = []
    loop = asyncio.get_running_loop()
    slow_until = loop.time() + SLOW_PHASE
    while loop.time() < slow_until:
        item = (await stream.__anext__()).data()
        seen.append(item["i"])
        assert len(item["pad"]) == PAD
        most_queued = max(most_queued, queued(stream))
        if len(seen) % 10 == 0:
            server_peak = max(server_peak, rss(server_proc))
            client_peak = max(client_peak, rss(client_proc))
        await asyncio.sleep(SLOW_READ_PAUSE)

    assert len(seen) < N_ITEMS // 4  # the reader really was slow: most of the stream is unread
    assert most_queued <= DEFAULT_WINDOW  # the client never queued more than it granted
    growth = {"server": server_peak - server_base, "client": client_peak - client_base}
    assert max(growth.values()) < bound, (growth, bound)

    # The rest, read at full speed: every item exactly once, in order, intact.
    async for response in stream:
        item = response.data()
        seen.append(item["i"])
        assert len(item["pad"]) == PAD
    assert seen == list(range(N_ITEMS))


# -- in process: the client's queue against the credit window ---------------------------------

WINDOW = 64
SMALL_N = 3000


@pytest.fixture
async def producer(make_runtime, namespace: str) -> AsyncIterator[dict[str, Any]]:
    """A runtime whose endpoint counts how many items it produced, and a connection to it."""
    path = f"{namespace}.worker.produce"
    state: dict[str, Any] = {"produced": 0, "path": path}

    async def produce(request: dict[str, Any]):
        for i in range(request["n"]):
            state["produced"] += 1
            yield {"i": i, "pad": "x" * 100}

    srv = make_runtime(static=())
    await srv.endpoint(path).start_serving(produce)
    res = Resources("test")
    conn = PeerConnection(res, srv.address)
    conn.start()
    try:
        await conn.wait_described(10)
        state["server"], state["conn"] = srv._server, conn
        yield state
    finally:
        await conn.close()
        await res.close()


async def test_the_client_queue_is_bounded_by_the_credit_window(producer: dict[str, Any]) -> None:
    conn: PeerConnection = producer["conn"]
    stream: ResponseStream = await conn.open_stream(
        producer["path"], encode_item({"n": SMALL_N}), window=WINDOW, decode=plain_items
    )
    queued = stream._st.items

    # Not reading: the server sends exactly one window, then waits for credit.
    await eventually(lambda: len(queued) == WINDOW, "one window of items arrives")
    [server_stream] = producer["server"]._streams.values()
    await eventually(lambda: not server_stream.buf, "the server flushed what it produced")
    assert server_stream.credit == 0
    await asyncio.sleep(0.3)  # room to overshoot, if anything would
    assert len(queued) == WINDOW
    assert producer["produced"] <= WINDOW + 1  # the generator was not run ahead either

    # Reading in bursts, with pauses that let the server refill: still bounded, all in order.
    seen: list[int] = []
    done = False
    while not done:
        for _ in range(20):
            try:
                seen.append((await stream.__anext__())["i"])
            except StopAsyncIteration:
                done = True
                break
        await asyncio.sleep(0.002)
        assert len(queued) <= WINDOW
        assert producer["produced"] - len(seen) <= WINDOW + 1
    assert seen == list(range(SMALL_N))
    await eventually(lambda: not producer["server"]._streams, "the server forgets the stream")
