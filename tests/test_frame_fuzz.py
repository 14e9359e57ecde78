"""Frame fuzzing (issue 20): generated garbage (``dynamo_zmq.tools.frame_fuzz``: random
multipart, truncated MessagePack, wrong types, huge ints, invalid UTF-8) on every ZMQ port.

- A real mocker worker's request port: every frame the protocol promises to answer is
  answered, the worker never logs a traceback, and it still serves a normal request.
- The same worker's KV replay ROUTER: valid replay requests are still answered, the worker
  keeps serving.
- A router's KV-event and load subscribers fed by a fake publisher: garbage is counted and
  skipped, and what the router knows (indexed blocks, load) is exactly what it was.

``scripts/fuzz_frames.py`` runs the same generators far longer."""

from __future__ import annotations

import asyncio
import random
import socket
from pathlib import Path
from typing import Any

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamo_zmq.llm import LOAD_TOPIC, LOAD_VERSION, EngineLoad, LoadReport, encode_report
from dynamo_zmq.resources import Resources
from dynamo_zmq.tools.frame_fuzz import (
    answerable,
    kv_event_frames,
    load_frames,
    replay_answerable,
    replay_frames,
    request_frames,
)
from dynamo_zmq.wire import Kind
from router.events import BlockStored, encode_batch
from router.indexer import KvIndexer
from router.load import LoadSubscriber
from router.scheduler import LoadTracker
from router.subscriber import KvEventSubscriber

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
ANSWER_MS = 5000
WID = 0xF00D
BS = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def zctx() -> Any:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def worker(namespace, spawn, tiny_model) -> Any:
    replay = free_port()
    proc = spawn(
        "-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path", str(tiny_model),
        "--model-name", "tiny", "--namespace", namespace, "--host", "127.0.0.1",
        "--discovery", "static", "--speedup-ratio", "1000", "--kv-replay-port", str(replay),
    )
    proc.replay = f"tcp://127.0.0.1:{replay}"
    return proc


def log_text(proc: Any) -> str:
    return Path(proc.log.name).read_text(errors="replace")


async def assert_serves(make_runtime: Any, proc: Any, namespace: str) -> None:
    assert proc.running(), proc.logs()
    client = await make_runtime(static=(proc.address,)).endpoint(
        f"{namespace}.backend.generate").client()
    await client.wait_for_instances(timeout=15)
    request = {"token_ids": [1, 2, 3, 4, 5], "stop": {"max_tokens": 3, "ignore_eos": True}}
    chunks = [r.data() async for r in await client.generate(request)]
    assert chunks[-1]["finish_reason"] == "length"


async def test_request_port(worker, namespace, make_runtime, zctx) -> None:
    endpoint = f"{namespace}.backend.generate"

    @FUZZ
    @given(rng=st.randoms(use_true_random=False))
    def barrage(rng: random.Random) -> None:
        frames = request_frames(rng, endpoint)
        sock = zctx.socket(zmq.DEALER)  # one peer per frame: every answer is this frame's
        sock.linger = 0
        sock.connect(worker.address)
        try:
            sock.send_multipart(frames)
            if answerable(frames):
                assert sock.poll(ANSWER_MS), f"no answer to {frames!r:.300}"
                assert sock.recv_multipart()[0] in (
                    Kind.ERROR, Kind.BATCH, Kind.DATA, Kind.PONG, Kind.INFO, Kind.NOTICE)
        finally:
            sock.close(linger=0)

    barrage()
    await assert_serves(make_runtime, worker, namespace)
    assert "Traceback" not in log_text(worker), log_text(worker)[-3000:]


async def test_replay_port(worker, namespace, make_runtime, zctx) -> None:
    @FUZZ
    @given(rng=st.randoms(use_true_random=False))
    def barrage(rng: random.Random) -> None:
        frames = replay_frames(rng)
        sock = zctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(worker.replay)
        try:
            sock.send_multipart(frames)
            if replay_answerable(frames):
                assert sock.poll(ANSWER_MS), f"no replay answer to {frames!r}"
        finally:
            sock.close(linger=0)

    barrage()
    await assert_serves(make_runtime, worker, namespace)
    sock = zctx.socket(zmq.DEALER)
    sock.connect(worker.replay)
    sock.send_multipart([b"", (0).to_bytes(8, "big")])  # a valid replay: ends with the marker
    try:
        while True:
            assert sock.poll(ANSWER_MS)
            if sock.recv_multipart()[-2] == b"\xff" * 8:
                break
    finally:
        sock.close(linger=0)
    assert "Traceback" not in log_text(worker), log_text(worker)[-3000:]


async def test_router_kv_event_and_load_subscribers(zctx, caplog) -> None:
    kv_pub, load_pub = zctx.socket(zmq.PUB), zctx.socket(zmq.PUB)
    kv_port = kv_pub.bind_to_random_port("tcp://127.0.0.1")
    load_port = load_pub.bind_to_random_port("tcp://127.0.0.1")
    index, tracker = KvIndexer(BS), LoadTracker()
    kv = KvEventSubscriber(Resources("fuzz"), WID, f"tcp://127.0.0.1:{kv_port}", index)
    load = LoadSubscriber(
        Resources("fuzz"), WID, f"tcp://127.0.0.1:{load_port}",
        lambda w, ranks, _at: [tracker.report((w, r.dp_rank), r.active_blocks) for r in ranks],
    )
    kv.start()
    load.start()
    seq, load_seq = 0, 0
    prompt = [3] * (2 * BS)

    def publish_valid() -> None:
        nonlocal seq, load_seq
        kv_pub.send_multipart([b"kv", seq.to_bytes(8, "big"),
                               encode_batch([BlockStored([11, 12], None, prompt, BS)], 0)])
        load_pub.send_multipart([LOAD_TOPIC, encode_report(
            LoadReport(LOAD_VERSION, WID, load_seq, 1.0, [EngineLoad(0, 7)]))])
        seq, load_seq = seq + 1, load_seq + 1

    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 15
        while kv.last_seq is None or load.stats.applied == 0:  # slow joiners
            assert loop.time() < deadline
            publish_valid()
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        view = (index.find_matches(prompt), tracker.load((WID, 0)))
        assert view == ({(WID, 0): 2}, 7)
        kv_before, load_before = kv.stats.received, load.stats.received
        sent = {"kv": 0, "load": 0}

        @FUZZ
        @given(rng=st.randoms(use_true_random=False))
        def barrage(rng: random.Random) -> None:
            # Queued while this runs; the subscribers read them afterwards.
            nonlocal seq
            kv_frames, lf = kv_event_frames(rng, seq), load_frames(rng, WID)
            kv_pub.send_multipart(kv_frames)
            if len(kv_frames) == 3 and len(kv_frames[1]) == 8:
                seq += 1  # the batch at seq was garbage: skipped, but seq is accounted for
            load_pub.send_multipart(lf)
            sent["kv"] += 1
            sent["load"] += lf[0].startswith(LOAD_TOPIC)  # what the subscription lets through

        barrage()
        deadline = loop.time() + 30
        while (kv.stats.received - kv_before < sent["kv"]
               or load.stats.received - load_before < sent["load"]):
            assert loop.time() < deadline, (kv.stats, load.stats, sent)
            await asyncio.sleep(0.05)
        assert kv.running and load.running
        assert (index.find_matches(prompt), tracker.load((WID, 0))) == view
        assert kv.stats.gaps == 0 and kv.stats.state_drops == 0, kv.stats
        assert kv.stats.decode_errors > 0 and load.stats.decode_errors > 0
        # Garbage is logged as one line per kind per 10 s (this run takes a few seconds).
        for name in ("router.subscriber", "router.load"):
            lines = [r for r in caplog.records if r.name == name]
            assert len(lines) <= 4, [r.getMessage() for r in lines]
        # Still following: a valid batch and report after the garbage apply.
        applied = kv.stats.applied, load.stats.applied
        publish_valid()
        assert await kv.wait_for_seq(seq - 1)
        deadline = loop.time() + 10
        while load.stats.applied == applied[1]:
            assert loop.time() < deadline, load.stats
            await asyncio.sleep(0.02)
        assert kv.stats.applied == applied[0] + 1
    finally:
        await kv.close()
        await load.close()
        kv_pub.close(linger=0)
        load_pub.close(linger=0)
