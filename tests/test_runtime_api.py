"""The Dynamo-compatible Python API, in one process and as a ported Dynamo worker."""

from __future__ import annotations

import asyncio
import gc
import signal

import msgspec
import pytest

from dynamo_zmq import errors
from dynamo_zmq.runtime import Context, DistributedRuntime, dynamo_endpoint
from tests.support.waiting import until


async def serve(rt: DistributedRuntime, path: str, handler) -> None:
    await rt.endpoint(path).start_serving(handler)


async def client_for(make_runtime, server: DistributedRuntime, path: str):
    client = await make_runtime(static=(server.address,)).endpoint(path).client()
    await client.wait_for_instances(timeout=10)
    return client


async def test_paths_and_names(make_runtime):
    rt = make_runtime()
    assert (
        rt.endpoint("a.b.c").path
        == rt.namespace("a").component("b").endpoint("c").path
        == "a.b.c"
    )
    assert rt.endpoint("dyn://a.b.c").path == "a.b.c"
    for bad in ("a.b", "a.b.c.d", "a..c"):
        with pytest.raises(errors.InvalidArgument):
            rt.endpoint(bad)


async def test_handler_forms(make_runtime):
    server = make_runtime(static=())

    async def plain(request):
        yield request["x"] + 1

    async def with_context(request, context):
        yield context.id()

    class Owner:
        async def method(self, request, context):
            yield "method"

    async def single(request):
        return {"one": request}

    await serve(server, "ns.c.plain", plain)
    await serve(server, "ns.c.ctx", with_context)
    await serve(server, "ns.c.method", Owner().method)
    await serve(server, "ns.c.single", single)

    c = await client_for(make_runtime, server, "ns.c.plain")
    assert [r.data() async for r in await c.generate({"x": 1})] == [2]
    assert [x async for x in await c.generate({"x": 5}, annotated=False)] == [6]

    c = await client_for(make_runtime, server, "ns.c.ctx")
    ctx = Context("my-request-id")
    assert [r.data() async for r in await c.generate({}, context=ctx)] == ["my-request-id"]

    c = await client_for(make_runtime, server, "ns.c.method")
    assert [r.data() async for r in await c.random({})] == ["method"]

    c = await client_for(make_runtime, server, "ns.c.single")
    assert [r.data() async for r in await c.generate(7)] == [{"one": 7}]


async def test_errors_cross_the_wire_typed(make_runtime):
    server = make_runtime(static=())

    async def failing(request):
        yield 1
        if request == "shutdown":
            raise errors.EngineShutdown("going away")
        raise RuntimeError("kaboom")

    await serve(server, "ns.c.fail", failing)
    c = await client_for(make_runtime, server, "ns.c.fail")
    got = []
    with pytest.raises(errors.EngineShutdown, match="going away"):
        async for r in await c.generate("shutdown"):
            got.append(r.data())
    assert got == [1]
    with pytest.raises(errors.Unknown, match="kaboom"):
        async for _ in await c.generate("other"):
            pass


class Req(msgspec.Struct):
    n: int


async def test_dynamo_endpoint_validates(make_runtime):
    server = make_runtime(static=())

    @dynamo_endpoint(Req, dict)
    async def handler(request: Req):
        for i in range(request.n):
            yield {"i": i}

    await serve(server, "ns.c.gen", handler)
    c = await client_for(make_runtime, server, "ns.c.gen")
    assert [r.data()["i"] async for r in await c.generate({"n": 3})] == [0, 1, 2]
    with pytest.raises(errors.InvalidArgument, match="invalid request"):
        async for _ in await c.generate({"n": "three"}):
            pass


async def test_deadline_and_idle_timeout(make_runtime):
    server = make_runtime(static=())

    async def slow(request):
        yield "first"
        await asyncio.sleep(60)
        yield "never"

    await serve(server, "ns.c.slow", slow)
    c = await client_for(make_runtime, server, "ns.c.slow")
    seen = []
    with pytest.raises(errors.ResponseTimeout):
        async for r in await c.generate({}, timeout=1.0):
            seen.append(r.data())
    assert seen == ["first"]
    with pytest.raises(errors.ResponseTimeout):
        async for _ in await c.generate({}, idle_timeout=0.3):
            pass
    # Both requests are gone from the server, not left running.
    for _ in range(100):
        if not server._server._streams:
            break
        await asyncio.sleep(0.02)
    assert not server._server._streams


async def test_unregister_and_register_again(make_runtime):
    server = make_runtime(static=())

    async def hello(request):
        yield "hi"

    await serve(server, "ns.c.hello", hello)
    endpoint = server.endpoint("ns.c.hello")
    endpoint._handler = hello
    c = await client_for(make_runtime, server, "ns.c.hello")
    await server.endpoint("ns.c.hello").unregister_endpoint_instance()
    await until(c, lambda: not c.instance_ids(), timeout=5)
    assert c.instance_ids() == []
    with pytest.raises(errors.CannotConnect):
        await c.generate({})
    await endpoint.register_endpoint_instance()
    assert await c.wait_for_instances(timeout=5) == [server.instance_id]


async def test_drain_finishes_inflight_and_refuses_new(make_runtime):
    server = make_runtime(static=())

    async def words(request, context):
        for i in range(5):
            yield i
            await asyncio.sleep(0.05)

    await serve(server, "ns.c.words", words)
    c = await client_for(make_runtime, server, "ns.c.words")
    inflight = await c.generate({})
    drained = asyncio.create_task(server.drain(timeout=10))
    assert [r.data() async for r in inflight] == [0, 1, 2, 3, 4]
    assert await drained is True
    await until(c, lambda: not c.instance_ids(), timeout=5)
    assert c.instance_ids() == []


async def test_ported_dynamo_worker_process(namespace, spawn, make_runtime):
    """tests/support/dynamo_style_worker.py is Dynamo code with the import changed."""
    proc = spawn(
        "tests/support/dynamo_style_worker.py",
        namespace,
        env={"DYN_DISCOVERY": "static", "DYN_HOST": "127.0.0.1"},
    )
    client = await (
        make_runtime(static=(proc.address,)).endpoint(f"{namespace}.backend.generate").client()
    )
    await client.wait_for_instances(timeout=15)
    words = [r.data()["word"] async for r in await client.generate({"text": "the quick brown fox"})]
    assert words == ["the", "quick", "brown", "fox"]

    # SIGTERM mid-request: the request still completes, then the process exits 0.
    stream = await client.generate({"text": "a b c d e f g h", "delay": 0.1})
    first = await stream.__anext__()
    proc.signal(signal.SIGTERM)
    rest = [r.data()["word"] async for r in stream]
    assert [first.data()["word"], *rest] == list("abcdefgh")
    assert await asyncio.to_thread(proc.wait, 20) == 0


async def test_failover_before_the_first_response(make_runtime):
    """A retryable failure before any response moves the request; direct calls never move."""
    a, b = make_runtime(static=()), make_runtime(static=())

    async def who(request):
        yield request

    for rt in (a, b):
        await serve(rt, "ns.c.who", who)
    client = await make_runtime(static=(a.address, b.address)).endpoint("ns.c.who").client()
    assert await until(client, lambda: len(client.instance_ids()) == 2)
    a._server.refusing = True  # a admits nothing but still looks routable: the worst case

    for i in range(4):
        stream = await client.round_robin(i)
        assert [r.data() async for r in stream] == [i]
        assert stream.instance_id == b.instance_id
    with pytest.raises(errors.EngineShutdown):
        async for _ in await client.direct(0, a.instance_id):
            pass


async def test_excluded_instances_are_not_sent_to_nor_failed_over_to(make_runtime):
    """``exclude`` (a migrated request's lost instances) holds for the first pick and for
    failover; with nothing else live the call fails with CannotConnect."""
    a, b, c = (make_runtime(static=()) for _ in range(3))

    async def who(request):
        yield request

    for rt in (a, b, c):
        await serve(rt, "ns.c.who", who)
    client = await make_runtime(static=(a.address, b.address, c.address)).endpoint(
        "ns.c.who"
    ).client()
    assert await until(client, lambda: len(client.instance_ids()) == 3)
    b._server.refusing = True  # b fails every request before its first response: failover
    for i in range(4):
        stream = await client.stream(i, int, exclude=frozenset({a.instance_id}))
        assert [x async for x in stream] == [i]
        assert stream.instance_id == c.instance_id
    with pytest.raises(errors.CannotConnect):
        await client.stream(0, int, exclude=frozenset({a.instance_id, b.instance_id,
                                                       c.instance_id}))


async def test_direct_mode_client_needs_an_instance(make_runtime):
    server = make_runtime(static=())

    async def echo(request):
        yield request

    await serve(server, "ns.c.echo", echo)
    client = await make_runtime(static=(server.address,)).endpoint("ns.c.echo").client("direct")
    await client.wait_for_instances(timeout=10)
    with pytest.raises(errors.InvalidArgument):
        await client.generate(1)
    assert [r.data() async for r in await client.generate(1, instance_id=server.instance_id)] == [1]


async def test_kill_abandons_items_already_received(make_runtime):
    server = make_runtime(static=())

    async def burst(request, context):
        for i in range(50):
            yield i
        await context.killed()

    await serve(server, "ns.c.burst", burst)
    c = await client_for(make_runtime, server, "ns.c.burst")
    ctx = Context()
    stream = await c.generate({}, context=ctx, annotated=False)
    assert await stream.__anext__() == 0
    for _ in range(100):  # let the rest of the burst arrive unread
        if len(stream._st.items) == 49:
            break
        await asyncio.sleep(0.01)
    ctx.kill()
    with pytest.raises(errors.Cancelled):
        await stream.__anext__()


class Point(msgspec.Struct):
    x: int


async def test_an_item_that_cannot_be_encoded_fails_its_stream_after_the_items_before_it(
    make_runtime, caplog
):
    """Items are encoded a frame at a time: a bad one must not take its frame's good items
    (or the stream's other frames, or other streams) with it."""
    server = make_runtime(static=())
    release = asyncio.Event()

    async def handler(request):
        if request == "slow":  # the good items go out in earlier frames
            for i in range(3):
                yield {"i": i}
                await asyncio.sleep(0.01)
        elif request == "together":  # the bad item shares a frame with good ones
            yield {"i": 0}
            yield {"i": 1}
        if request != "ok":
            yield object()
            await release.wait()  # never reached: the stream fails, the handler is ended
            yield {"i": 99}
        else:
            yield {"i": "ok"}

    await serve(server, "ns.c.bad", handler)
    client = await client_for(make_runtime, server, "ns.c.bad")
    for request, good in (("slow", 3), ("together", 2), ("first", 0)):
        got = []
        with pytest.raises(errors.Unknown, match="cannot encode object"):
            async for item in await client.generate(request, annotated=False):
                got.append(item)
        assert got == [{"i": i} for i in range(good)], request
    # The server serves on, and nothing of the failed streams is left open.
    assert [x async for x in await client.generate("ok", annotated=False)] == [{"i": "ok"}]
    assert await until(client, lambda: not server._server._streams, 5)
    assert any("cannot be encoded" in r.getMessage() for r in caplog.records)


async def test_an_item_that_does_not_fit_the_callers_type_fails_after_the_items_before_it(
    make_runtime,
):
    server = make_runtime(static=())

    async def handler(request):
        yield {"x": 1}
        yield {"x": 2}
        yield {"x": "not an int"}
        yield {"x": 4}

    await serve(server, "ns.c.typed", handler)
    client = await client_for(make_runtime, server, "ns.c.typed")
    got = []
    with pytest.raises(errors.Unknown, match="undecodable response item"):
        async for point in await client.stream({}, Point):
            got.append(point)
    assert got == [Point(1), Point(2)]
    assert await until(client, lambda: not server._server._streams, 5)


async def test_a_dropped_stream_is_killed_at_once_without_the_garbage_collector(make_runtime):
    """The failover hook does not keep its stream alive: dropping it sends KILL right away."""
    server = make_runtime(static=())

    async def forever(request, context):
        while True:
            yield 1
            await asyncio.sleep(0.01)

    await serve(server, "ns.c.forever", forever)
    client = await client_for(make_runtime, server, "ns.c.forever")
    gc.disable()
    try:
        stream = await client.generate({}, annotated=False)  # round-robin: with failover
        assert await stream.__anext__() == 1
        assert len(server._server._streams) == 1
        del stream
        assert await until(client, lambda: not server._server._streams, 5)
    finally:
        gc.enable()
