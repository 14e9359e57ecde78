"""Router replica sync through real processes: two kv-mode frontends with
``--router-replica-sync`` over mocker workers. A request routed by one frontend counts in the
other's load for that worker until it completes; a replica killed mid-request has its
contributions dropped; garbage on the sync socket is counted, not fatal, while a well-formed
peer (a real runtime in the test) is applied, its request whose end never comes expires after
``--router-replica-ttl``, and one whose FREE was lost ends at the snapshot asked for again once
it has counted a tenth of that; a replica started while another's request is in flight counts
it (the snapshot it asks for on joining)."""

from __future__ import annotations

import asyncio
import random
import signal

import openai
import zmq

from router._replica_wire import ADD, FREE, REPLICA_TOPIC, ReplicaEvent, encode_event, pack_hashes
from router.hashing import block_hashes
from router.replica_sync import META_KEY, replica_path
from tests.support.completions import complete_worker
from tests.support.metrics import fetch_sample
from tests.support.mocker_fleet import mocker_fleet, serving, start_frontend, start_mocker
from tests.support.waiting import eventually

BLOCK = 16
SYNC = ("--router-replica-sync",)


def worker(spawn, namespace, model_dir, *extra: str):
    return start_mocker(spawn, namespace, model_dir, "--block-size", str(BLOCK), *extra,
                        speedup="0.5")


async def replica_blocks(url: str, workers) -> dict[str, float]:
    return {f"{w.instance_id:x}": await fetch_sample(url, "dynamo_router_replica_active_blocks",
                                                     worker=f"{w.instance_id:x}") for w in workers}


async def start(spawn, namespace, tiny_model, fronts: int = 2, extra: tuple[str, ...] = ()):
    workers = [worker(spawn, namespace, tiny_model) for _ in range(2)]
    procs = [start_frontend(spawn, namespace, *SYNC, *extra) for _ in range(fronts)]
    for proc in procs:
        await serving(proc, workers)
    if fronts > 1:
        for proc in procs:
            await eventually(lambda p=proc: fetch_sample(p.address, "dynamo_router_replica_peers"),
                             30, "the other replica followed")
    return workers, procs


def prompt(seed: int, blocks: int = 4) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(blocks * BLOCK)]


async def test_a_peer_routed_request_counts_until_it_completes(namespace, spawn, tiny_model):
    workers, (f1, f2) = await start(spawn, namespace, tiny_model)
    # A long request through frontend 1 (hundreds of decode steps at half speed).
    long = asyncio.create_task(asyncio.to_thread(complete_worker, f1.address, prompt(1), 300))
    seen = await eventually(
        lambda: _nonzero(replica_blocks(f2.address, workers)), 30,
        "frontend 2 counting frontend 1's request")
    assert await fetch_sample(f2.address, "dynamo_router_replica_requests") == 1
    routed_to = await long
    # The worker frontend 1 chose is the one frontend 2 charged: its prompt (4 blocks) and
    # expected output blocks.
    assert set(seen) == {routed_to} and seen[routed_to] >= 4

    async def freed() -> bool:
        blocks = await replica_blocks(f2.address, workers)
        return (not any(blocks.values())
                and await fetch_sample(f2.address, "dynamo_router_replica_requests") == 0)

    await eventually(freed, 30, "frontend 2 releasing the completed request")
    assert await fetch_sample(f2.address, "dynamo_router_replica_events_received_total",
                              kind="free") >= 1
    assert await fetch_sample(f1.address, "dynamo_router_replica_events_sent_total",
                              kind="add") >= 1
    # Frontend 1 counts nothing of its own as a peer's.
    assert await fetch_sample(f1.address, "dynamo_router_replica_requests") == 0

    # A replica that stops cleanly withdraws its replica endpoint: frontend 2 lets it go.
    f1.signal(signal.SIGTERM)
    assert await asyncio.to_thread(f1.wait, 20) == 0
    assert "Traceback" not in f1.logs()
    await eventually(lambda: _zero(fetch_sample(f2.address, "dynamo_router_replica_peers")), 30,
                     "frontend 2 dropping the stopped replica")


async def test_a_replica_that_joins_late_counts_what_was_in_flight(namespace, spawn, tiny_model):
    """A frontend started while another's request is in flight counts that request: its ADD
    went out before the newcomer subscribed, and the newcomer's snapshot of the peer brings it
    in (router/_replica_snapshot.py). The request's end (its client leaves) releases it."""
    # Slow workers (a twentieth of the mocker's speed): the request outlives frontend 2's
    # start however slow the machine, and the test ends it by closing the stream.
    fleet = await mocker_fleet(spawn, namespace, tiny_model, 2, speedup="0.05",
                               worker_args=("--block-size", str(BLOCK)), frontend_args=SYNC)
    workers, f1 = fleet.workers, fleet.front
    client = openai.AsyncOpenAI(base_url=f"{f1.address}/v1", api_key="none", max_retries=0)
    stream = await client.completions.create(model="tiny", prompt=prompt(9), max_tokens=1900,
                                             stream=True)
    try:
        assert (await anext(aiter(stream))).choices  # routed and generating
        f2 = start_frontend(spawn, namespace, *SYNC)
        await serving(f2, workers)
        seen = await eventually(lambda: _nonzero(replica_blocks(f2.address, workers)), 30,
                                "frontend 2 counting the request routed before it started")
        assert len(seen) == 1 and next(iter(seen.values())) >= 4
        assert await fetch_sample(f2.address, "dynamo_router_replica_requests") == 1
        assert await fetch_sample(f2.address, "dynamo_router_replica_snapshots_total",
                                  outcome="applied") >= 1
        # No ADD reached frontend 2: it went out once, before frontend 2 existed.
        assert await fetch_sample(f1.address, "dynamo_router_replica_events_sent_total",
                                  kind="add") == 1
        assert await fetch_sample(f2.address, "dynamo_router_replica_events_received_total",
                                  kind="add") == 0
    finally:
        await stream.close()
        await client.close()

    async def freed() -> bool:
        return (await fetch_sample(f2.address, "dynamo_router_replica_requests") == 0
                and not any((await replica_blocks(f2.address, workers)).values()))

    await eventually(freed, 30, "frontend 2 releasing the request when it ends")


async def test_a_killed_replica_stops_counting(namespace, spawn, tiny_model):
    workers, (f1, f2) = await start(spawn, namespace, tiny_model)
    long = asyncio.create_task(asyncio.to_thread(complete_worker, f1.address, prompt(2), 600))
    await eventually(lambda: _nonzero(replica_blocks(f2.address, workers)), 30,
                     "frontend 2 counting frontend 1's request")
    f1.signal(signal.SIGKILL)  # no FREE will ever come
    with_err = asyncio.gather(long, return_exceptions=True)

    async def dropped() -> bool:
        return (await fetch_sample(f2.address, "dynamo_router_replica_requests") == 0
                and await fetch_sample(f2.address, "dynamo_router_replica_peers") == 0)

    await eventually(dropped, 60, "frontend 2 dropping the killed replica's request")
    assert not any((await replica_blocks(f2.address, workers)).values())
    assert await fetch_sample(f2.address, "dynamo_router_replica_expired_requests_total",
                              reason="peer_left") >= 1
    await with_err
    # Frontend 2 routes on.
    assert await asyncio.to_thread(complete_worker, f2.address, prompt(3), 2)


async def test_garbage_is_counted_and_a_peers_events_applied(
    namespace, spawn, tiny_model, make_runtime
):
    ttl = 5  # seconds a peer's request counts without its FREE
    workers, (front,) = await start(spawn, namespace, tiny_model, fronts=1,
                                    extra=("--router-replica-ttl", str(ttl)))
    url = front.address
    path = f"{namespace}.backend.generate"
    # A peer replica: a real runtime advertising the replica endpoint, its PUB socket raw.
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    rt = make_runtime()
    meta = {META_KEY: {"events": f"tcp://127.0.0.1:{port}", "model": "tiny", "path": path}}

    # Its snapshots (asked for when the frontend starts following it, and after a gap).
    snapshot = {"seq": -1, "requests": []}

    async def answer(request):
        yield snapshot if request == {"snapshot": True} else {}

    try:
        await rt.endpoint(replica_path(path, "tiny")).start_serving(answer, meta)
        await eventually(lambda: fetch_sample(url, "dynamo_router_replica_peers"), 30,
                         "the frontend following the test's replica")
        garbage = [[REPLICA_TOPIC, b"\xc1not msgpack"], [REPLICA_TOPIC], [b"x", b"y", b"z"],
                   [REPLICA_TOPIC, encode_event(ReplicaEvent(1, 7, rt.instance_id, 0, 1))],
                   [REPLICA_TOPIC, encode_event(ReplicaEvent(1, ADD, 12345, 0, 1))]]

        async def counted() -> bool:
            for frames in garbage:
                pub.send_multipart(frames)
            return (await fetch_sample(url, "dynamo_router_replica_decode_errors_total")
                    >= len(garbage))

        await eventually(counted, 30, "garbage counted")
        # A well-formed ADD for a real worker counts; its FREE releases it.
        w = f"{workers[0].instance_id:x}"
        hashes = pack_hashes(block_hashes(prompt(4), BLOCK))
        pub.send_multipart([REPLICA_TOPIC, encode_event(ReplicaEvent(
            1, ADD, rt.instance_id, 0, 9, workers[0].instance_id, 0, hashes, 3))])
        await eventually(lambda: fetch_sample(url, "dynamo_router_replica_active_blocks", worker=w),
                         10, "the peer's request counted")
        assert await fetch_sample(url, "dynamo_router_replica_active_blocks", worker=w) == 4 + 3
        pub.send_multipart([REPLICA_TOPIC, encode_event(ReplicaEvent(
            1, FREE, rt.instance_id, 1, 9))])

        async def released() -> bool:
            return (await fetch_sample(url, "dynamo_router_replica_requests") == 0
                    and not await fetch_sample(url, "dynamo_router_replica_active_blocks",
                                               worker=w))

        await eventually(released, 10, "the peer's request released")
        # A gap (events 2-4 lost): the frontend asks for a snapshot, which holds request 77.
        snapshot["seq"] = 5
        snapshot["requests"] = [[77, workers[0].instance_id, 0, hashes, 3, 0]]
        pub.send_multipart([REPLICA_TOPIC, encode_event(ReplicaEvent(
            1, FREE, rt.instance_id, 5, 55))])
        await eventually(lambda: fetch_sample(url, "dynamo_router_replica_requests"), ttl,
                         "the snapshot's request counted")
        assert await fetch_sample(url, "dynamo_router_replica_gaps_total") == 3
        assert await fetch_sample(url, "dynamo_router_replica_active_blocks", worker=w) == 4 + 3
        pub.send_multipart([REPLICA_TOPIC, encode_event(ReplicaEvent(
            1, FREE, rt.instance_id, 6, 77))])
        await eventually(released, 10, "the snapshot's request released by its FREE")
        assert await fetch_sample(url, "dynamo_router_replica_snapshots_total",
                                  outcome="applied") >= 1
        # An ADD whose FREE never comes counts for the TTL, then no more.
        pub.send_multipart([REPLICA_TOPIC, encode_event(ReplicaEvent(
            1, ADD, rt.instance_id, 7, 10, workers[0].instance_id, 0, hashes, 3))])
        await eventually(lambda: fetch_sample(url, "dynamo_router_replica_requests"), ttl,
                         "the unanswered request counted")
        # (Meanwhile it counts for longer than ttl / 10, so the frontend asks for a snapshot
        # again: this one, as of event 5, is older than event 7 it heard, and is refused.)
        await eventually(lambda: fetch_sample(url, "dynamo_router_replica_expired_requests_total",
                                              reason="ttl"), ttl + 10, "the request expired")
        assert await fetch_sample(url, "dynamo_router_replica_requests") == 0
        assert await fetch_sample(url, "dynamo_router_replica_snapshots_total",
                                  outcome="failed") >= 1
        # A FREE lost with no later event (no gap shows): the snapshot asked for once the
        # request has counted ttl / 10 seconds, as of that FREE, releases it before the TTL.
        snapshot["seq"], snapshot["requests"] = 9, []
        pub.send_multipart([REPLICA_TOPIC, encode_event(ReplicaEvent(
            1, ADD, rt.instance_id, 8, 11, workers[0].instance_id, 0, hashes, 3))])
        await eventually(lambda: fetch_sample(url, "dynamo_router_replica_expired_requests_total",
                                              reason="snapshot"), ttl + 10,
                         "the resync releasing it")
        assert await fetch_sample(url, "dynamo_router_replica_requests") == 0
        assert await fetch_sample(url, "dynamo_router_replica_expired_requests_total",
                                  reason="ttl") == 1
        assert await asyncio.to_thread(complete_worker, url, prompt(5), 2)  # still serving
    finally:
        pub.close(linger=0)


async def _zero(value) -> bool:
    return not await value


async def _nonzero(blocks) -> dict[str, float]:
    return {w: n for w, n in (await blocks).items() if n}


async def test_replicas_sync_under_curve(namespace, spawn, tiny_model, tmp_path):
    from dynamo_zmq.tools.keys import authorize, create_keypair

    keys = tmp_path / "keys"
    names = ("worker", "front1", "front2")
    for name in names:
        create_keypair(keys, name)
        authorize(keys, str(keys / f"{name}.key"))
    auth = {name: ("--auth-keys", str(keys), "--auth-key-name", name) for name in names}
    w = worker(spawn, namespace, tiny_model, *auth["worker"])
    f1, f2 = (start_frontend(spawn, namespace, *SYNC, *auth[n]) for n in ("front1", "front2"))
    for proc in (f1, f2):
        await serving(proc, [w])
        await eventually(lambda p=proc: fetch_sample(p.address, "dynamo_router_replica_peers"),
                         30, "the other replica followed")
    long = asyncio.create_task(asyncio.to_thread(complete_worker, f1.address, prompt(6), 300))
    await eventually(lambda: fetch_sample(f2.address, "dynamo_router_replica_requests"), 30,
                     "frontend 2 counting frontend 1's request over CURVE")
    await long
    await eventually(lambda: _zero(fetch_sample(f2.address, "dynamo_router_replica_requests")), 30,
                     "frontend 2 releasing it")
    assert await fetch_sample(f2.address, "dynamo_router_replica_decode_errors_total") == 0


async def test_python_m_router_weighs_a_frontends_requests(namespace, spawn, tiny_model,
                                                            make_runtime):
    _, (front,) = await start(spawn, namespace, tiny_model, fronts=1)
    spawn("-m", "router", "--namespace", namespace, "--host", "127.0.0.1", *SYNC)
    rt = make_runtime()
    client = await rt.endpoint(replica_path(f"{namespace}.backend.generate", "tiny")).client()

    async def statuses() -> list[dict]:
        out = []
        for iid in client.instance_ids():
            stream = await client.direct({}, iid)
            out += [r.data() async for r in stream]
        return out

    async def both_replicas() -> bool:
        got = await statuses()
        return len(got) == 2 and all(s["peers"] for s in got)

    await eventually(both_replicas, 30, "the frontend and python -m router following each other")

    async def router_hears_the_frontend() -> bool:
        # ZeroMQ's slow joiner: the router's subscription reaches the frontend's PUB some time
        # after it connects, and what is published before is lost. Short requests until the
        # router has heard one event from the frontend.
        await asyncio.to_thread(complete_worker, front.address, prompt(8), 1)
        return any(s["peers"] and not s["sent"] and None not in s["heard"].values()
                   for s in await statuses())

    await eventually(router_hears_the_frontend, 30, "python -m router hearing the frontend", 0.5)
    long = asyncio.create_task(asyncio.to_thread(complete_worker, front.address, prompt(7), 300))

    async def router_counts() -> dict | None:
        # Only python -m router can count a peer's request: it routes (publishes) nothing.
        for s in await statuses():
            if sum(s["peers"].values()) == 1:
                return s
        return None

    counted = await eventually(router_counts, 30, "python -m router counting the request")
    routed_to = await long
    assert [k.split("/")[0] for k in counted["blocks"]] == [routed_to]
