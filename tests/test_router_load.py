"""Worker load in the KV router (router/load.py and KvRouter): malformed messages are counted and
never fatal; a frontend steers away from a worker that others loaded, because the worker
publishes its load; an engine without ``load()`` publishes nothing and routing still works."""

from __future__ import annotations

import asyncio
import random
import re
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from dynamo_zmq.llm import (
    LOAD_TOPIC,
    LOAD_VERSION,
    EngineLoad,
    LoadReport,
    PreprocessedRequest,
    StopConditions,
    encode_report,
)
from dynamo_zmq.resources import Resources
from router.kv_router import KvRouter
from router.load import LoadSubscriber, ReportClock
from router.metrics import RouterMetrics
from router.scheduler import LoadTracker
from tests.support.completions import complete_header_body
from tests.support.metrics import index_blocks_per_rank, metrics_page
from tests.support.mocker_fleet import mocker_fleet
from tests.support.waiting import eventually, until

WID = 0xABC
BLOCK = 16


@pytest.fixture
def zctx() -> Any:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def report(seq: int, *ranks: EngineLoad, instance: int = WID) -> list[bytes]:
    return [LOAD_TOPIC, encode_report(LoadReport(LOAD_VERSION, instance, seq, 1.0, list(ranks)))]


def metric(metrics: RouterMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name, {"model": "m"})
    return 0.0 if value is None else value


async def wait_applied(sub: LoadSubscriber, n: int, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while sub.stats.applied < n:
        assert loop.time() < deadline, sub
        await asyncio.sleep(0.01)


async def test_malformed_load_messages_are_counted_and_never_fatal(zctx):
    pub = zctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    tracker = LoadTracker()
    metrics = RouterMetrics()
    sub = LoadSubscriber(
        Resources("test"), WID, f"tcp://127.0.0.1:{port}",
        lambda w, ranks, _at: [tracker.report((w, r.dp_rank), r.active_blocks) for r in ranks],
        dp_size=2, metrics=metrics, model="m",
    )
    sub.start()
    try:
        seq = 0
        while sub.stats.applied == 0:  # ZMQ's slow joiner: publish until the SUB is connected
            pub.send_multipart(report(seq, EngineLoad(0, 1)))
            seq += 1
            await asyncio.sleep(0.01)
        errors_before, applied_before = sub.stats.decode_errors, sub.stats.applied
        bad = [
            [LOAD_TOPIC],                                           # one frame
            [LOAD_TOPIC, b"", b""],                                 # three frames
            # another topic, same prefix
            [b"loadx", encode_report(LoadReport(1, WID, 10**6, 1.0, []))],
            [LOAD_TOPIC, b"\xc1garbage"],                           # not MessagePack
            [LOAD_TOPIC, msgpack.packb([2, WID, 10**6, 1.0, []])],  # another version
            [LOAD_TOPIC, msgpack.packb([1, WID, 10**6, 1.0, [[0, -5]]])],  # negative blocks
            [LOAD_TOPIC, msgpack.packb({"version": 1})],            # a map
            report(10**6, EngineLoad(0, 99), instance=WID + 1),     # another worker's report
        ]
        for frames in bad:
            pub.send_multipart(frames)
        # Valid ranks of a report apply; a rank the worker does not have is counted.
        pub.send_multipart(report(seq, EngineLoad(0, 40), EngineLoad(5, 7)))
        pub.send_multipart(report(seq - 1, EngineLoad(0, 1000)))  # older than what was applied
        pub.send_multipart(report(seq + 1, EngineLoad(0, 41), EngineLoad(1, 3)))
        await wait_applied(sub, applied_before + 2)
        assert sub.running
        assert sub.stats.decode_errors - errors_before == len(bad) + 1, sub.stats
        assert sub.stats.stale == 1
        assert metric(metrics, "dynamo_router_load_decode_errors_total") == sub.stats.decode_errors
        assert metric(metrics, "dynamo_router_load_reports_total") == sub.stats.applied
        assert tracker.load((WID, 0)) == 41 and tracker.load((WID, 1)) == 3
        assert (WID, 5) not in tracker.candidates()
    finally:
        await sub.close()
        pub.close()
    pub_frames = report(10**7, EngineLoad(0, 5))
    assert sub.handle(pub_frames) is False  # closed: nothing more is delivered


def test_report_clock_measures_how_long_a_report_was_held_up_whatever_the_clock_offset():
    wall, mono = [5000.0], [100.0]
    clock = ReportClock(window=10.0, wall=lambda: wall[0], mono=lambda: mono[0])
    skew = -3600.0  # the worker's clock is an hour behind

    def arrive(measured: float, trip: float) -> float | None:
        wall[0], mono[0] = measured + trip, measured - 4900.0 + trip
        return clock.measured_at(measured + skew)

    def near(mono_time: float):  # to within the quickest trip, which cannot be told apart
        return pytest.approx(mono_time, abs=0.0015)

    assert arrive(5000.0, 0.001) == near(100.0)  # the quickest trip sets the floor
    assert arrive(5001.0, 0.051) == near(101.0)  # held up 50 ms: measured 50 ms before now
    assert arrive(5002.0, 0.0005) == near(102.0)  # quicker still: the new floor
    assert clock.measured_at(float("nan")) is None
    assert clock.measured_at(float("inf")) is None
    # The worker's clock is stepped back a second: its reports look a second old, until the
    # old floor has left the window (10 to 20 s).
    skew -= 1.0
    assert arrive(5003.0, 0.0005) == near(102.0)
    for t in range(5004, 5030):
        last = arrive(float(t), 0.0005)
    assert last == near(5029.0 - 4900.0)


frames_strategy = st.lists(st.binary(max_size=64), max_size=4) | st.tuples(
    st.just(LOAD_TOPIC),
    st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
        | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=6),
        max_leaves=30,
    ).map(msgpack.packb),
).map(list)


@given(st.lists(frames_strategy, max_size=5))
def test_handle_never_raises_and_only_valid_reports_reach_the_router(messages):
    seen: list[tuple[int, list[EngineLoad]]] = []
    sub = LoadSubscriber(Resources("test"), WID, "tcp://127.0.0.1:1",
                         lambda w, r, _at: seen.append((w, r)), dp_size=2)
    for frames in messages:
        sub.handle(frames)
    assert sub.stats.received == len(messages)
    assert all(
        w == WID and all(0 <= r.dp_rank < 2 and r.active_blocks >= 0 for r in ranks)
        for w, ranks in seen
    )


# -- real processes ---------------------------------------------------------------------------


def reported_blocks(metrics: str, key: str) -> float:
    for m in re.finditer(
        r"^dynamo_router_reported_active_blocks\{(.*)\} (\S+)$", metrics, re.MULTILINE
    ):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if f"{labels.get('worker')}/{labels.get('dp_rank')}" == key:
            return float(m.group(2))
    return 0.0


async def test_a_frontend_avoids_a_worker_others_loaded_because_it_publishes_its_load(
    namespace, spawn, make_runtime, tiny_model
):
    """Frontend B routes by KV cache and load. Worker X caches the prefix of B's prompts, so on
    B's own prediction (it routed nothing) X is the cheaper worker. But another caller keeps X
    busy with long requests; X publishes that load, and B sends its requests to Y instead."""
    fleet = await mocker_fleet(spawn, namespace, tiny_model, 2, speedup="1",
                               worker_args=("--block-size", str(BLOCK)))
    (x, y), url = fleet.workers, fleet.url
    xid, yid = f"{x.instance_id:x}", f"{y.instance_id:x}"
    client = await make_runtime().endpoint(f"{namespace}.backend.generate").client()
    assert await until(
        client, lambda: set(client.instance_ids()) == {x.instance_id, y.instance_id}, 15
    )

    rng = random.Random(7)
    prefix = [rng.randrange(10, 500) for _ in range(4 * BLOCK)]
    warm = await client.direct(
        {"token_ids": [*prefix, 1], "stop": {"max_tokens": 1}}, x.instance_id
    )
    assert [r.data() async for r in warm][-1]["finish_reason"] == "length"

    async def b_indexed_the_prefix() -> bool:
        return index_blocks_per_rank(await metrics_page(url)).get(f"{xid}/0", 0) >= 4

    await eventually(b_indexed_the_prefix, 15, "X's cached prefix in the frontend's index")

    # Another caller (not the frontend) loads X with long requests: 4 x 8 prompt blocks.
    long_streams = []
    try:
        for _ in range(4):
            tokens = [rng.randrange(10, 500) for _ in range(8 * BLOCK)]
            stream = await client.direct(
                {"token_ids": tokens, "stop": {"max_tokens": 1800, "ignore_eos": True}},
                x.instance_id,
            )
            await stream.__anext__()  # running on X
            long_streams.append(stream)

        async def b_sees_x_busy() -> bool:
            return reported_blocks(await metrics_page(url), f"{xid}/0") >= 32

        await eventually(b_sees_x_busy, 15, "X's published load at the frontend")
        # Prefix on X (4 of 6 blocks cached) + unrelated suffixes: X is cheaper by 4 blocks of
        # prefill, but dearer by >= 32 active blocks.
        for i in range(4):
            suffix = [rng.randrange(10, 500) for _ in range(2 * BLOCK + 1)]
            got, body = await asyncio.to_thread(complete_header_body, url, prefix + suffix, 2)
            assert got == f"{yid}/0", f"request {i} went to {got}, X is {xid}, Y is {yid}"
            assert body["choices"][0]["finish_reason"] == "length"
        text = await metrics_page(url)
        assert "dynamo_router_load_reports_total" in text
    finally:
        for stream in long_streams:
            await stream.aclose()


async def test_an_engine_without_load_publishes_nothing_and_routing_still_works(
    namespace, spawn, make_runtime, tiny_model
):
    """EchoEngine has no ``load()``: no load endpoint, no subscriber, and the router spreads
    concurrent requests on its own prediction."""
    procs = [spawn("-m", "dynamo_zmq.worker", "--engine", "tests.support.engines:EchoEngine",
                   "--echo-delay", "0.01", "--model-path", str(tiny_model),
                   "--namespace", namespace, "--host", "127.0.0.1", ready=False)
             for _ in range(2)]
    for p in procs:
        p.wait_ready()
    rt = make_runtime()
    client = await rt.endpoint(f"{namespace}.backend.generate").client()
    router = await KvRouter(client, 16, runtime=rt, model="echo").start()
    streams = []
    try:
        ids = {p.instance_id for p in procs}
        assert await until(client, lambda: set(router.followed()) == ids, 15)
        for conn in client.instances():
            (info,) = [e for e in conn.description.endpoints if e.name == "generate"]
            assert "load_endpoint" not in info.metadata
            assert router.load_subscriber(conn.instance_id) is None
        for tokens in (list(range(10, 74)), list(range(100, 164))):
            req = PreprocessedRequest(tokens, stop=StopConditions(max_tokens=400))
            stream = await router.generate(req)
            await stream.__anext__()
            streams.append(stream)
        # The second went where the first's predicted load was not.
        assert {s.instance_id for s in streams} == ids
        for s in streams:
            assert router.loads.load((s.instance_id, 0)) > 0
        reports = router.metrics.registry.get_sample_value(
            "dynamo_router_load_reports_total", {"model": "echo"}
        )
        assert reports is None
    finally:
        for s in streams:
            await s.aclose()
        await router.close()
    assert all(router.loads.load((i, 0)) == 0 for i in ids)
