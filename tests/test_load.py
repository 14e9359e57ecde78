"""Worker load reports (dynamo_zmq/load.py): the message format, the publisher over a real PUB
socket with the mocker's ``load()`` behind it, and worker processes that advertise (or don't)
their load endpoint."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgpack
import msgspec
import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from dynamo_zmq.context import Context
from dynamo_zmq.llm import (
    LOAD_TOPIC,
    LOAD_VERSION,
    MAX_REPORT_BYTES,
    EngineLoad,
    LoadDecodeError,
    LoadReport,
    PreprocessedRequest,
    RoutingHints,
    StopConditions,
    decode_report,
    encode_report,
)
from dynamo_zmq.worker import LoadPublisher
from engines.mocker import MockerConfig, MockerEngine
from tests.support.waiting import until

counts = st.integers(min_value=0, max_value=2**32)
ranks = st.builds(EngineLoad, counts, counts, counts, counts, counts)
reports = st.builds(
    LoadReport, st.just(LOAD_VERSION), st.integers(1, 2**63 - 1), st.integers(0, 2**40),
    st.floats(0, 2e9), st.lists(ranks, max_size=8),
)


def test_a_report_is_plain_msgpack_with_the_version_first():
    report = LoadReport(
        LOAD_VERSION, 0xABC, 7, 1700000000.5, [EngineLoad(0, 12, 256, 3, 1), EngineLoad(1, 0, 256)]
    )
    payload = encode_report(report)
    assert msgpack.unpackb(payload) == [
        1, 0xABC, 7, 1700000000.5, [[0, 12, 256, 3, 1], [1, 0, 256, 0, 0]]
    ]
    assert decode_report(payload) == report
    # Older publishers may send fewer rank fields; the missing ones default.
    short = msgpack.packb([1, 0xABC, 8, 1.0, [[1, 5]]])
    assert decode_report(short).ranks == [EngineLoad(1, 5)]


@pytest.mark.parametrize("value", [
    [2, 1, 0, 1.0, []],                       # another version
    [1, 1, 0, 1.0, [[0, -1, 10, 0, 0]]],      # negative blocks
    [1, 1, 0, 1.0, [[-1, 1, 10, 0, 0]]],      # negative rank
    [1, 1, 0, 1.0, [["0", 1]]],               # a string where an int goes
    [1, 1, 0],                                # fields missing
    {"version": 1},                           # a map, not an array
    "load",
    None,
])
def test_invalid_reports_are_rejected_with_one_error_type(value):
    with pytest.raises(LoadDecodeError):
        decode_report(msgpack.packb(value))


@given(reports)
def test_reports_round_trip(report):
    assert decode_report(encode_report(report)) == report


@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_load_decode_error(payload):
    try:
        report = decode_report(payload)
    except LoadDecodeError:
        return
    assert report.version == LOAD_VERSION and all(r.active_blocks >= 0 for r in report.ranks)


def test_an_oversized_report_is_rejected_undecoded():
    huge = LoadReport(LOAD_VERSION, 1, 0, 0.0, [EngineLoad(i, 1) for i in range(200_000)])
    payload = encode_report(huge)
    assert len(payload) > MAX_REPORT_BYTES
    with pytest.raises(LoadDecodeError, match="over"):
        decode_report(payload)


def test_deep_nesting_is_a_load_decode_error():
    with pytest.raises(LoadDecodeError):
        decode_report(b"\x95\x01\x01\x00\x00" + b"\x91" * 100_000)


@pytest.fixture
def zctx() -> Any:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


class Sub:
    """A bare SUB socket on a publisher, returning decoded reports."""

    def __init__(self, zctx: Any, endpoint: str) -> None:
        self.sock = zctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, LOAD_TOPIC)
        self.sock.connect(endpoint)

    async def next(self, timeout: float = 10.0) -> LoadReport:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if self.sock.poll(0):
                topic, payload = self.sock.recv_multipart()
                assert topic == LOAD_TOPIC
                return decode_report(payload)
            await asyncio.sleep(0.01)  # the publisher runs on this loop
        raise AssertionError(f"no load report in {timeout}s")

    async def until(self, predicate, timeout: float = 10.0) -> LoadReport:
        """The first report for which ``predicate`` holds."""
        async def scan() -> LoadReport:
            while not predicate(report := await self.next()):
                pass
            return report

        return await asyncio.wait_for(scan(), timeout)

    def close(self) -> None:
        self.sock.close()


async def test_the_publisher_sends_the_mockers_ranks(zctx):
    engine = MockerEngine(MockerConfig(host="127.0.0.1", block_size=4, num_gpu_blocks=64,
                                       vocab_size=100, data_parallel_size=2, speedup_ratio=1.0,
                                       enable_kv_events=False))
    await engine.start(1)
    pub = LoadPublisher(engine.load, 0x5EED, "tcp://127.0.0.1:0", interval=0.02)
    await pub.start()
    sub = Sub(zctx, f"tcp://127.0.0.1:{pub.port}")
    ctx = Context()
    try:
        first = await sub.next()
        assert first.instance_id == 0x5EED and first.version == LOAD_VERSION
        assert [(r.dp_rank, r.active_blocks, r.total_blocks) for r in first.ranks] == [
            (0, 0, 64), (1, 0, 64)
        ]
        # A long request on rank 1: its blocks show there, and only there.
        req = PreprocessedRequest([5] * 17, stop=StopConditions(max_tokens=10_000, ignore_eos=True),
                                  routing=RoutingHints(dp_rank=1))
        stream = engine.generate(req, ctx)
        await stream.__anext__()
        report = await sub.until(lambda r: r.ranks[1].num_running == 1)
        r0, r1 = report.ranks
        assert r1.active_blocks >= 5 and r0.active_blocks == 0 and r0.num_running == 0
        assert report.seq > first.seq
        await stream.aclose()  # the sequence ends and frees its blocks
        await sub.until(lambda r: r.ranks[1].active_blocks == 0 and r.ranks[1].num_running == 0)
    finally:
        sub.close()
        await pub.close()
        await engine.cleanup()


async def test_a_failing_or_empty_source_sends_nothing_and_the_publisher_carries_on():
    state: dict[str, Any] = {"ranks": None}

    def source() -> list[EngineLoad] | None:
        if state["ranks"] == "boom":
            raise RuntimeError("engine stats unavailable")
        return state["ranks"]

    pub = LoadPublisher(source, 1, "tcp://127.0.0.1:0", interval=3600)
    await pub.start()
    try:
        assert pub.publish() is False and pub.sent == 0
        state["ranks"] = "boom"
        assert pub.publish() is False and pub.publish() is False
        state["ranks"] = [EngineLoad(0, 3)]
        assert pub.publish() is True and pub.sent == 1
    finally:
        await pub.close()
        await pub.close()


async def test_an_unchanged_load_is_sent_again_only_at_the_heartbeat(zctx):
    ranks = [EngineLoad(0, 3, 64)]
    pub = LoadPublisher(lambda: ranks, 7, "tcp://127.0.0.1:0", interval=3600, heartbeat=2.0)
    await pub.start()  # its own loop sends the first report at once; ticks below are ours
    sub = Sub(zctx, f"tcp://127.0.0.1:{pub.port}")
    try:
        while pub.publish() and not sub.sock.poll(50):
            pass  # until the subscription is up (a PUB drops what it sends before)
        now = time.monotonic() + 1000.0
        assert pub.tick(now) is True  # a heartbeat past the start's report
        assert pub.tick(now + 0.1) is False and pub.tick(now + 1.9) is False  # unchanged
        ranks = [EngineLoad(0, 4, 64)]
        assert pub.tick(now + 2.0) is True  # changed: sent at once
        assert pub.tick(now + 2.1) is False
        assert pub.tick(now + 4.0) is True  # the heartbeat of an unchanged load
        sent = pub.sent
        assert pub.publish() is True and pub.sent == sent + 1  # publish() always sends
        seen = await sub.until(lambda r: r.seq == sent)
        assert [(r.dp_rank, r.active_blocks) for r in seen.ranks] == [(0, 4)]
    finally:
        sub.close()
        await pub.close()


def test_a_publisher_needs_a_positive_interval():
    with pytest.raises(ValueError):
        LoadPublisher(lambda: [], 1, "tcp://127.0.0.1:0", interval=0)


def worker(spawn, namespace, model, *extra: str):
    return spawn("-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path", str(model),
                 "--namespace", namespace, "--host", "127.0.0.1", "--speedup-ratio", "1000", *extra,
                 ready=False)


async def test_workers_advertise_their_load_endpoint_unless_told_not_to(
    namespace, spawn, make_runtime, tiny_model, zctx
):
    publishing = worker(
        spawn, namespace, tiny_model, "--data-parallel-size", "2", "--load-interval", "0.05"
    )
    silent = worker(spawn, namespace, tiny_model, "--load-interval", "0")
    for proc in (publishing, silent):
        proc.wait_ready()
    rt = make_runtime()
    client = await rt.endpoint(f"{namespace}.backend.generate").client()
    ids = {publishing.instance_id, silent.instance_id}
    assert await until(client, lambda: set(client.instance_ids()) == ids, 15)
    meta = {}
    for conn in client.instances():
        (info,) = [e for e in conn.description.endpoints if e.name == "generate"]
        meta[conn.instance_id] = info.metadata
    assert "load_endpoint" not in meta[silent.instance_id]
    endpoint = meta[publishing.instance_id]["load_endpoint"]
    assert endpoint.startswith("tcp://127.0.0.1:")
    sub = Sub(zctx, endpoint)
    try:
        report = await sub.next()
        assert report.instance_id == publishing.instance_id
        assert [r.dp_rank for r in report.ranks] == [0, 1]
        total = msgspec.convert(meta[publishing.instance_id]["engine"], dict)["total_kv_blocks"]
        assert all(r.total_blocks == total for r in report.ranks)
    finally:
        sub.close()
