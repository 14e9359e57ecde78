"""Streams that stop moving, through real processes: a frozen instance (SIGSTOP) leaves routing
as soon as a ping goes unanswered (while another instance answers), long before its streams are
failed, and keeps them if it thaws in time; a stream whose handler stops yielding ends with the
retryable ``StreamStalled`` after its stall timeout (and the server's handler is killed);
waiting for a first item is not a stall while the instance is healthy, and is once its health
check withdraws the endpoint."""

from __future__ import annotations

import asyncio
import signal

import pytest

from dynamo_zmq import errors
from dynamo_zmq.transport import PeerState
from tests.conftest import app_args
from tests.support.waiting import until

#: Canary timings of the test app: an endpoint idle for 0.2 s is probed.
CANARY_ENV = {"DYN_CANARY_WAIT_TIME": "0.2", "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "2"}


async def one_client(spawn, make_runtime, namespace, *flags: str, env=None):
    """A test app (static discovery) and a client of its ``count``."""
    server = spawn(*app_args(namespace, "--discovery", "static", *flags), env=env)
    runtime = make_runtime(static=(server.address,))
    client = await runtime.endpoint(f"{namespace}.backend.count").client()
    assert await client.wait_for_instances(timeout=15) == [server.instance_id]
    client.journal = runtime.endpoint(f"{namespace}.backend.journal")
    return server, client


async def journal_says(client, context_id: str, want: str, timeout: float = 10.0) -> bool:
    """Whether the app's journal of ``context_id`` shows ``want`` within ``timeout``."""
    journal = await client.journal.client()
    await journal.wait_for_instances(timeout=10)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        entries = [r.data() async for r in await journal.generate({"context_id": context_id})]
        if want in entries:
            return True
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.1)


async def test_a_frozen_instance_leaves_routing_at_once_and_keeps_its_streams_if_it_thaws(
    namespace, spawn, make_runtime
):
    frozen = spawn(*app_args(namespace, "--discovery", "static"))
    other = spawn(*app_args(namespace, "--discovery", "static"))
    runtime = make_runtime(static=(frozen.address, other.address))
    client = await runtime.endpoint(f"{namespace}.backend.count").client()
    both = sorted([frozen.instance_id, other.instance_id])
    assert await until(client, lambda: client.instance_ids() == both, 15)
    (conn,) = [c for c in client.instances() if c.instance_id == frozen.instance_id]
    # Streams are failed only after this long of silence: far beyond the test.
    conn.liveness.timeout = 60.0
    stream = await client.direct({"n": 40, "delay": 0.05}, frozen.instance_id)
    await stream.__anext__()
    frozen.signal(signal.SIGSTOP)
    try:
        assert await until(client, lambda: client.instance_ids() == [other.instance_id], 20), (
            "a frozen instance is still routed to"
        )
        assert conn.state is PeerState.SILENT
        # A silent instance is routed to only when none answers: here one does.
        served = set()
        for _ in range(4):
            served |= {r.data()["instance"] async for r in await client.generate({"n": 1})}
        assert served == {other.instance_id}
    finally:
        frozen.signal(signal.SIGCONT)
    assert await until(client, lambda: client.instance_ids() == both, 20)
    rest = [item.data()["i"] async for item in stream]  # the same stream, never failed
    assert rest == list(range(1, 40))


async def test_a_stream_whose_handler_stops_yielding_stalls_and_is_killed(
    namespace, spawn, make_runtime
):
    _, client = await one_client(spawn, make_runtime, namespace)
    stream = await client.generate({"n": 3, "delay": 3600})  # one item, then nothing
    stream.set_stall_timeout(0.5)
    assert (await stream.__anext__()).data()["i"] == 0
    with pytest.raises(errors.StreamStalled) as stalled:
        await stream.__anext__()
    assert stalled.value.retryable and isinstance(stalled.value, errors.Disconnected)
    assert await journal_says(client, stream.context.id(), "killed"), "the handler still runs"
    # The instance itself is fine: it stays routable and serves.
    assert client.instance_ids() and len([r async for r in await client.generate({"n": 2})]) == 2


async def test_a_long_wait_for_the_first_item_on_a_healthy_instance_is_no_stall(
    namespace, spawn, make_runtime
):
    _, client = await one_client(spawn, make_runtime, namespace)
    stream = await client.generate({"n": 2, "wait": 1.5})  # a "prefill" 5x the stall timeout
    stream.set_stall_timeout(0.3)
    assert [r.data()["i"] async for r in stream] == [0, 1]


async def test_a_first_item_awaited_from_an_instance_whose_health_fails_stalls(
    namespace, spawn, make_runtime, tmp_path
):
    switch = tmp_path / "broken"
    _, client = await one_client(spawn, make_runtime, namespace, "--canary-file", str(switch),
                                 env=CANARY_ENV)
    stream = await client.generate({"n": 2, "wait": 3600})
    stream.set_stall_timeout(0.3)
    assert await journal_says(client, stream.context.id(), "started")
    switch.touch()  # its health canary fails now: the endpoint leaves its description
    with pytest.raises(errors.StreamStalled):
        await asyncio.wait_for(stream.__anext__(), 30)


async def test_a_silent_instance_is_still_routed_to_when_no_other_answers(
    namespace, spawn, make_runtime
):
    """Its loop held up (here: frozen) with no other instance: requests still go to it and are
    served once it answers, rather than failing at once for want of an instance."""
    server, client = await one_client(spawn, make_runtime, namespace)
    (conn,) = client.instances()
    conn.liveness.timeout = 60.0  # never DOWN here
    server.signal(signal.SIGSTOP)
    try:
        assert await until(client, lambda: conn.state is PeerState.SILENT, 20)
        assert client.instance_ids() == [server.instance_id]
        stream = await client.generate({"n": 3})
    finally:
        server.signal(signal.SIGCONT)
    assert [r.data()["i"] async for r in stream] == [0, 1, 2]
