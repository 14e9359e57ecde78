"""Transport behaviour seen from a raw DEALER: coalescing, prompt delivery, credit."""

from __future__ import annotations

import asyncio

import msgspec
import zmq
import zmq.asyncio

from dynamo_zmq.wire import Batch, Credit, Data, End, Kind, Request, encode, encode_item

_data = msgspec.msgpack.Decoder(Data)
_end = msgspec.msgpack.Decoder(End)
_batch = msgspec.msgpack.Decoder(Batch)


async def _raw_stream(
    address: str, endpoint: str, payload, window: int = 1_000_000, credit_after=None
):
    """Yield ('data', Data) / ('end', End) frames for one request over a bare DEALER."""
    zctx = zmq.asyncio.Context()
    sock = zctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(address)
    try:
        await sock.send_multipart(
            [Kind.REQUEST, encode(Request(1, endpoint, "ctx", encode_item(payload), window))]
        )
        while True:
            if not await sock.poll(10_000):
                raise TimeoutError("server went quiet")
            kind, body = await sock.recv_multipart()
            if kind == Kind.DATA:
                frame = _data.decode(body)
                yield "data", frame
                if credit_after is not None:
                    await sock.send_multipart([Kind.CREDIT, encode(Credit(1, credit_after(frame)))])
            elif kind == Kind.END:
                yield "end", _end.decode(body)
                return
            elif kind == Kind.BATCH:  # several frames in one message: the same, in order
                batch = _batch.decode(body)
                for frame in batch.data:
                    yield "data", frame
                for end in batch.ends:
                    yield "end", end
                    return
            else:
                raise AssertionError(f"unexpected frame {kind!r}")
    finally:
        sock.close()
        zctx.term()


async def test_items_ready_together_share_frames(make_runtime):
    rt = make_runtime(static=())

    async def burst(request):
        for i in range(request):  # no await between items: all ready in one loop tick
            yield i

    await rt.endpoint("ns.c.burst").start_serving(burst)
    frames, items = 0, []
    async for kind, msg in _raw_stream(rt.address, "ns.c.burst", 2000):
        if kind == "data":
            frames += 1
            items += [msgspec.msgpack.decode(x) for x in msg.items]
    assert items == list(range(2000))
    assert frames < 2000 // 10  # coalesced, many items per frame


async def test_an_idle_stream_sends_each_item_at_once(make_runtime):
    rt = make_runtime(static=())
    release = asyncio.Event()

    async def gated(request):
        yield "first"
        await release.wait()  # the producer is blocked until the first item was received
        yield "second"

    await rt.endpoint("ns.c.gated").start_serving(gated)
    seen = []
    async for kind, msg in _raw_stream(rt.address, "ns.c.gated", None):
        if kind == "data":
            seen += [msgspec.msgpack.decode(x) for x in msg.items]
            release.set()
        else:
            assert msg.seq == len(seen)  # terminal counts every DATA frame
    assert seen == ["first", "second"]


async def test_producer_waits_for_credit(make_runtime):
    rt = make_runtime(static=())
    produced = 0

    async def many(request):
        nonlocal produced
        for i in range(100):
            produced += 1
            yield i

    await rt.endpoint("ns.c.many").start_serving(many)
    zctx = zmq.asyncio.Context()
    sock = zctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(rt.address)
    try:
        await sock.send_multipart(
            [Kind.REQUEST, encode(Request(1, "ns.c.many", "ctx", encode_item(None), 10))]
        )
        received = []
        while len(received) < 10:
            assert await sock.poll(5000)
            kind, body = await sock.recv_multipart()
            received += _data.decode(body).items
        await asyncio.sleep(0.3)
        assert not await sock.poll(0)  # nothing beyond the window
        assert produced <= 11  # the generator was not run ahead of the credit
        await sock.send_multipart([Kind.CREDIT, encode(Credit(1, 1000))])
        while True:
            assert await sock.poll(5000)
            kind, body = await sock.recv_multipart()
            if kind == Kind.END:
                break
            if kind == Kind.BATCH:
                batch = _batch.decode(body)
                received += [x for d in batch.data for x in d.items]
                if batch.ends:
                    break
                continue
            received += _data.decode(body).items
        assert [msgspec.msgpack.decode(x) for x in received] == list(range(100))
    finally:
        sock.close()
        zctx.term()


async def test_concurrent_streams_to_one_client_share_messages(make_runtime):
    """Items of many streams produced in one tick reach the client in far fewer messages."""
    server = make_runtime(static=())
    tick = asyncio.Event()

    async def lockstep(request):
        for i in range(20):
            yield i
            await tick.wait()  # every stream yields once per tick, like an engine step

    await server.endpoint("ns.c.lockstep").start_serving(lockstep)
    client = await make_runtime(static=(server.address,)).endpoint("ns.c.lockstep").client()
    await client.wait_for_instances(timeout=10)
    streams = [await client.generate(None, annotated=False) for _ in range(32)]
    conn = client.instances()[0]
    frames_before = conn.frames_received

    async def ticker():
        for _ in range(40):
            await asyncio.sleep(0.01)
            tick.set()
            tick.clear()

    ticking = asyncio.create_task(ticker())
    results = []
    for stream in streams:
        results.append([x async for x in stream])
    await ticking
    assert results == [list(range(20))] * 32
    assert conn.frames_received - frames_before < 32 * 20 // 4


async def test_a_stall_of_the_server_does_not_reap_a_client_that_kept_pinging(make_runtime):
    """The server's loop blocked past CLIENT_TIMEOUT while a client kept sending: the reaper,
    even when it runs before the receive loop, reads what arrived and keeps the client."""
    import threading
    import time

    from dynamo_zmq.transport.server import CLIENT_TIMEOUT
    from dynamo_zmq.wire import Ping

    rt = make_runtime(static=())

    async def echo(request):
        yield request

    await rt.endpoint("ns.c.echo").start_serving(echo)
    server = rt._server
    zctx = zmq.Context()
    sock = zctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(rt.address)
    stop = threading.Event()

    def pinger() -> None:  # a live client: pings on its own thread, whatever our loop does
        nonce = 0
        while not stop.is_set():
            nonce += 1
            sock.send_multipart([Kind.PING, encode(Ping(nonce))])
            stop.wait(0.2)

    thread = threading.Thread(target=pinger, daemon=True)
    thread.start()
    try:
        await asyncio.sleep(0.5)
        (identity,) = server._last_seen
        time.sleep(CLIENT_TIMEOUT * 1.5)  # noqa: ASYNC251 - the stall under test
        server._reap()  # the reaper, as if it ran first after the stall
        assert identity in server._last_seen
    finally:
        stop.set()
        thread.join()
        sock.close()
        zctx.term()


async def test_a_stream_longer_than_the_reapers_timeout_is_not_reaped(make_runtime):
    """The caller keeps pinging while a stream's data flows (the pings, not the data, keep it
    alive for the server's reaper): a stream twice CLIENT_TIMEOUT long ends whole."""
    from dynamo_zmq.transport.server import CLIENT_TIMEOUT

    rt = make_runtime(static=())

    async def slow(request):
        for i in range(int(2 * CLIENT_TIMEOUT / 0.1)):
            await asyncio.sleep(0.1)
            yield i

    await rt.endpoint("ns.c.slow").start_serving(slow)
    client = await make_runtime(static=(rt.address,)).endpoint("ns.c.slow").client()
    await client.wait_for_instances(timeout=10)
    items = [x async for x in await client.generate(None, annotated=False)]
    assert items == list(range(int(2 * CLIENT_TIMEOUT / 0.1)))


async def test_a_pools_connections_share_one_ping_task(make_runtime):
    """However many peers a process knows, one task pings them all."""
    servers = [make_runtime(static=()) for _ in range(3)]

    async def echo(request):
        yield request

    for srv in servers:
        await srv.endpoint("ns.c.echo").start_serving(echo)
    caller = make_runtime(static=tuple(srv.address for srv in servers))
    client = await caller.endpoint("ns.c.echo").client()
    for _ in range(100):
        if len(client.instance_ids()) == 3:
            break
        await asyncio.sleep(0.05)
    assert len(client.instance_ids()) == 3
    names = [t.get_name() for t in asyncio.all_tasks()]
    assert names.count("peer-pings") == 1
    assert not [n for n in names if n.startswith("peer-") and n.endswith("-ping")]
