"""The runtime's primary lease (the DistributedRuntime document's lease, without etcd).

Its id is the instance id in every registration; revoking it, or losing a registration that
cannot be renewed, withdraws the runtime's adverts and shuts it down: ``serve_endpoint``
returns, ``wait_shutdown`` returns, a served process exits, and clients see the instance leave.
Another mDNS responder claiming the instance's name is not such a loss: the process announces
itself under a new name and keeps serving. Real runtimes and real processes, mDNS on loopback.
"""

from __future__ import annotations

import asyncio

import pytest

from dynamo_zmq import errors
from dynamo_zmq.discovery import Advert, DiscoveryConfig, MdnsDiscovery
from dynamo_zmq.discovery.mdns import instance_name
from dynamo_zmq.runtime import Lease
from tests.conftest import app_args
from tests.support.waiting import until

WAIT = 15.0


async def echo(request: dict):
    yield {"echo": request}


def test_a_lease_is_valid_until_revoked_once() -> None:
    lease = Lease(0xABC)
    seen: list[str] = []
    lease.add_listener(seen.append)
    assert lease.id() == 0xABC and lease.is_valid() and lease.reason is None
    lease.revoke("test")
    lease.revoke("again")  # idempotent: the first reason stays
    assert not lease.is_valid() and lease.reason == "test" and seen == ["test"]
    late: list[str] = []
    lease.add_listener(late.append)  # a listener added after the end hears it at once
    assert late == ["test"]
    assert "lost: test" in repr(lease)


@pytest.mark.parametrize("static", [False, True], ids=["mdns", "static"])
async def test_revoking_the_lease_stops_serve_endpoint_and_clients_see_it_leave(
    make_runtime, namespace: str, static: bool
) -> None:
    server = make_runtime(static=() if static else None)
    endpoint = server.namespace(namespace).component("backend").endpoint("echo")
    serving = asyncio.create_task(endpoint.serve_endpoint(echo))
    try:
        await until_bound(server)
        caller = make_runtime(static=(server.address,) if static else None)
        client = await caller.endpoint(f"{namespace}.backend.echo").client()
        assert await client.wait_for_instances(timeout=WAIT) == [server.instance_id]

        lease = server.primary_lease()
        assert lease.id() == server.lease_id() == endpoint.lease_id() == server.instance_id
        assert lease.is_valid()
        lease.revoke()

        assert not lease.is_valid()
        await asyncio.wait_for(server.wait_shutdown(), WAIT)
        await asyncio.wait_for(serving, WAIT)  # serve_endpoint returned by itself
        assert await until(client, lambda: client.instance_ids() == [], WAIT)
        with pytest.raises(errors.EngineShutdown, match="lease"):
            await server.namespace(namespace).component("backend").endpoint("new").start_serving(
                echo
            )
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)


async def exit_code(proc) -> int:
    """Wait (without blocking this event loop) for ``proc`` to exit by itself."""
    return await asyncio.to_thread(proc.wait, WAIT)


async def until_bound(runtime) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while not runtime.address:
        assert loop.time() < deadline, "the runtime never bound its socket"
        await asyncio.sleep(0.01)


async def test_a_served_process_stops_when_its_lease_is_revoked(
    namespace: str, spawn, make_runtime
) -> None:
    server = spawn(*app_args(namespace, "--lease-endpoint"))
    caller = make_runtime()
    count = await caller.endpoint(f"{namespace}.backend.count").client()
    assert await count.wait_for_instances(timeout=WAIT) == [server.instance_id]
    lease = await caller.endpoint(f"{namespace}.backend.lease").client()
    await lease.wait_for_instances(timeout=WAIT)

    answer = [r.data() async for r in await lease.generate({"revoke": True})]

    # The lease id is the instance id the process registered (and printed) under.
    assert answer == [{"lease_id": server.instance_id, "valid": True}]
    assert await until(count, lambda: count.instance_ids() == [], WAIT)
    assert await exit_code(server) == 0  # stopped serving and exited by itself
    assert "revoked by a caller" in server.logs()


async def test_a_process_whose_mdns_name_is_claimed_keeps_serving_under_a_new_name(
    namespace: str, spawn, make_runtime
) -> None:
    server = spawn(*app_args(namespace))
    caller = make_runtime()
    count = await caller.endpoint(f"{namespace}.backend.count").client()
    assert await count.wait_for_instances(timeout=WAIT) == [server.instance_id]

    # Another responder publishes the server's instance name with another target: a stray or
    # cloned responder. The server gives the name up for a new one; it never stops.
    rogue = MdnsDiscovery(DiscoveryConfig(mdns_interfaces=("127.0.0.1",)))
    renamed = f"as {instance_name(namespace, server.instance_id, 2)} from now on"
    try:
        port = int(server.address.rsplit(":", 1)[1])
        claim = Advert(namespace, server.instance_id, (f"tcp://127.0.0.1:{port + 1}",))
        await rogue.advertise(claim)
        assert await until(count, lambda: renamed in server.logs(), WAIT), server.logs()
        await asyncio.sleep(2)  # the keep-alive renews meanwhile, four times a second
        assert server.running()
        assert count.instance_ids() == [server.instance_id]
        assert [r.data() async for r in await count.generate({"n": 2})]  # still served
    finally:
        await rogue.close()
    assert server.logs().count("another responder claims") == 1, server.logs()
    # A fresh caller finds it under its new name.
    fresh = await make_runtime().endpoint(f"{namespace}.backend.count").client()
    assert await fresh.wait_for_instances(timeout=WAIT) == [server.instance_id]
