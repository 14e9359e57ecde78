"""The request plane across real processes: discovery, streaming, routing, cancellation, death."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import signal
import time

import pytest

from dynamo_zmq import errors
from dynamo_zmq.runtime import Context
from tests.conftest import app_args
from tests.support.waiting import until


async def collect(stream) -> list:
    return [r.data() async for r in stream]


async def test_two_processes_discover_over_mdns_and_stream(namespace, spawn, make_runtime):
    server = spawn(*app_args(namespace))
    client = await make_runtime().endpoint(f"{namespace}.backend.count").client()
    assert await client.wait_for_instances(timeout=15) == [server.instance_id]
    items = await collect(await client.generate({"n": 50}))
    assert [it["i"] for it in items] == list(range(50))
    assert {it["instance"] for it in items} == {server.instance_id}


async def test_two_processes_with_static_discovery(namespace, spawn, make_runtime):
    server = spawn(*app_args(namespace, "--discovery", "static"))
    client = await (
        make_runtime(static=(server.address,)).endpoint(f"{namespace}.backend.count").client()
    )
    assert await client.wait_for_instances(timeout=15) == [server.instance_id]
    items = await collect(await client.generate({"n": 20}))
    assert [it["i"] for it in items] == list(range(20))


async def test_namespaces_are_isolated(namespace, spawn, make_runtime):
    spawn(*app_args(namespace))
    other = make_runtime()
    client = await other.endpoint(f"{namespace}x.backend.count").client()
    with pytest.raises(errors.ConnectionTimeout):
        await client.wait_for_instances(timeout=3)


async def _journal(client, context_id: str, want: str, timeout: float = 10.0) -> list[str]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        entries = await collect(await client.generate({"context_id": context_id}))
        if want in entries or loop.time() > deadline:
            return entries
        await asyncio.sleep(0.1)


@pytest.mark.parametrize("how", ["stop", "kill"])
async def test_three_hops_share_one_context(namespace, spawn, make_runtime, how):
    spawn(*app_args(namespace))
    spawn(*app_args(namespace, "--role", "middle", "--component", "middle"))
    rt = make_runtime()
    relay = await rt.endpoint(f"{namespace}.middle.relay").client()
    journal = await rt.endpoint(f"{namespace}.backend.journal").client()
    await relay.wait_for_instances(timeout=15)
    await journal.wait_for_instances(timeout=15)

    ctx = Context()
    stream = await relay.generate({"n": 100_000, "delay": 0.01}, context=ctx)
    received = []
    with pytest.raises(errors.Cancelled) if how == "kill" else contextlib.nullcontext():
        async for item in stream:
            received.append(item.data()["i"])
            if len(received) == 3:
                getattr(ctx, how)()
    assert received[:3] == [0, 1, 2]
    if how == "stop":
        assert len(received) < 100_000  # ended early, gracefully, with its END terminal
    want = "stopped" if how == "stop" else "killed"
    assert want in await _journal(journal, ctx.id(), want)


async def test_sigkill_mid_stream_gives_disconnected_and_others_keep_serving(
    namespace, spawn, make_runtime
):
    victim = spawn(*app_args(namespace))
    survivor = spawn(*app_args(namespace))
    client = await make_runtime().endpoint(f"{namespace}.backend.count").client()
    await until(client, lambda: len(client.instance_ids()) == 2, timeout=15)
    assert sorted(client.instance_ids()) == sorted([victim.instance_id, survivor.instance_id])

    stream = await client.direct({"n": 100_000, "delay": 0.005}, victim.instance_id)
    got = 0
    with pytest.raises(errors.Disconnected):
        async for _ in stream:
            got += 1
            if got == 5:
                victim.signal(signal.SIGKILL)
    assert got >= 5

    # The dead instance leaves the routing set (liveness, not the mDNS TTL).
    await until(client, lambda: victim.instance_id not in client.instance_ids(), timeout=5)
    assert client.instance_ids() == [survivor.instance_id]
    for _ in range(5):
        items = await collect(await client.generate({"n": 3}))
        assert {it["instance"] for it in items} == {survivor.instance_id}


async def test_restarted_static_instance_is_picked_up_again(namespace, spawn, make_runtime):
    first = spawn(*app_args(namespace, "--discovery", "static"))
    port = first.address.rsplit(":", 1)[1]
    client = await (
        make_runtime(static=(first.address,)).endpoint(f"{namespace}.backend.count").client()
    )
    assert await client.wait_for_instances(timeout=15) == [first.instance_id]
    first.signal(signal.SIGKILL)
    first.wait()
    await until(client, lambda: not client.instance_ids(), timeout=5)
    assert client.instance_ids() == []
    second = spawn(*app_args(namespace, "--discovery", "static", "--port", port))
    assert await client.wait_for_instances(timeout=15) == [second.instance_id]
    assert len(await collect(await client.generate({"n": 4}))) == 4


async def test_round_robin_is_even_and_direct_is_exact(namespace, spawn, make_runtime):
    servers = [spawn(*app_args(namespace)) for _ in range(3)]
    client = await make_runtime().endpoint(f"{namespace}.backend.count").client()
    await until(client, lambda: len(client.instance_ids()) == 3, timeout=15)
    ids = sorted(s.instance_id for s in servers)
    assert client.instance_ids() == ids

    hits = collections.Counter()
    for _ in range(30):
        items = await collect(await client.round_robin({"n": 1}))
        hits[items[0]["instance"]] += 1
    assert hits == {iid: 10 for iid in ids}

    for target in ids:
        for _ in range(3):
            items = await collect(await client.direct({"n": 2}, target))
            assert {it["instance"] for it in items} == {target}

    with pytest.raises(errors.CannotConnect):
        await client.direct({"n": 1}, 12345)


async def test_a_stall_of_this_process_does_not_drop_a_live_instance(
    namespace, spawn, make_runtime
):
    """Our own event loop blocked past the liveness timeout (GC, CPU starvation): the instance
    kept sending meanwhile, so the liveness check, even when it runs before the receive loop,
    reads what arrived and keeps the instance routable."""
    server = spawn(*app_args(namespace, "--discovery", "static"))
    client = await (
        make_runtime(static=(server.address,)).endpoint(f"{namespace}.backend.count").client()
    )
    assert await client.wait_for_instances(timeout=15) == [server.instance_id]
    (conn,) = client.instances()
    stream = await client.generate({"n": 3, "delay": 0.3})  # items arrive during the stall
    time.sleep(2 * conn.liveness.timeout)  # noqa: ASYNC251 - the stall under test
    conn.liveness.check_silence()  # the liveness timer, as if it ran first after the stall
    assert conn.routable and client.instance_ids() == [server.instance_id]
    assert len([item async for item in stream]) == 3


async def test_a_stall_of_the_whole_machine_does_not_drop_a_live_instance(
    namespace, spawn, make_runtime
):
    """This process and the instance stall together (a busy or paused machine): when both come
    back, the liveness check must not judge the silence it slept through; it gives the instance a
    few pings' time to answer, and the instance stays routable with its stream intact."""
    server = spawn(*app_args(namespace, "--discovery", "static"))
    client = await (
        make_runtime(static=(server.address,)).endpoint(f"{namespace}.backend.count").client()
    )
    assert await client.wait_for_instances(timeout=15) == [server.instance_id]
    (conn,) = client.instances()
    # A stall past the liveness timeout but inside ZMQ's heartbeat timeout (1.5 s), which our
    # own I/O thread, not stalled here, keeps measuring.
    conn.liveness.timeout = 0.5
    downs: list[str] = []
    conn._on_change = lambda c: downs.append(c.state.value) if c.state.value == "down" else None
    stream = await client.generate({"n": 5, "delay": 0.2})
    server.signal(signal.SIGSTOP)
    time.sleep(0.9)  # noqa: ASYNC251 - the stall under test: this loop and the instance
    server.signal(signal.SIGCONT)
    assert len([item async for item in stream]) == 5
    assert not downs and conn.routable


async def test_a_frozen_instance_is_dropped_and_returns_when_it_thaws(
    namespace, spawn, make_runtime
):
    """SIGSTOP: no TCP reset, the process just stops answering (like a hung host)."""
    frozen = spawn(*app_args(namespace, "--discovery", "static"))
    client = await (
        make_runtime(static=(frozen.address,)).endpoint(f"{namespace}.backend.count").client()
    )
    assert await client.wait_for_instances(timeout=15) == [frozen.instance_id]
    stream = await client.generate({"n": 100_000, "delay": 0.005})
    got = 0
    try:
        with pytest.raises(errors.Disconnected):
            async for _ in stream:
                got += 1
                if got == 3:
                    frozen.signal(signal.SIGSTOP)
        assert await until(client, lambda: not client.instance_ids(), timeout=10)
    finally:
        frozen.signal(signal.SIGCONT)
    assert await client.wait_for_instances(timeout=15) == [frozen.instance_id]
    assert len(await collect(await client.generate({"n": 3}))) == 3
