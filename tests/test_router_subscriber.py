"""KV events from a real mocker engine into the router's index: live, replayed from 0, across gaps
(with and without a replay that can close them), undecodable batches, and workers that leave.

Ground truth is the engine itself: for each prompt, the leading blocks its rank really caches
(``match_prefix`` over the engine's own chained hashes) must be what the index reports."""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import zmq

from dynamo_zmq.context import Context
from dynamo_zmq.llm import PreprocessedRequest, RoutingHints, StopConditions
from dynamo_zmq.resources import Resources
from engines.mocker import MockerConfig, MockerEngine
from engines.mocker._hashing import chain_hashes
from router.events import BlockStored, encode_batch
from router.indexer import KvIndexer
from router.kv_router import KvRouter
from router.metrics import RouterMetrics
from router.subscriber import KvEventSubscriber
from tests.support.waiting import until

BS = 4
WID = 0xABC


@pytest.fixture
def zctx() -> Any:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


async def start_engine(**overrides: Any) -> MockerEngine:
    base: dict[str, Any] = {"speedup_ratio": 1e6, "host": "127.0.0.1", "block_size": BS,
                            "num_gpu_blocks": 16, "vocab_size": 1000, "data_parallel_size": 2,
                            "kv_event_form": "stores"}  # vLLM's event shape, read below
    engine = MockerEngine(MockerConfig(**{**base, **overrides}))
    await engine.start(worker_id=1)
    return engine


async def run(engine: MockerEngine, prompt: list[int], rank: int, max_tokens: int = 2) -> None:
    req = PreprocessedRequest(prompt, stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
                              routing=RoutingHints(dp_rank=rank))
    chunks = [c async for c in engine.generate(req, Context())]
    assert chunks[-1].finish_reason == "length"


def prompts(start: int, n: int) -> list[list[int]]:
    """``n`` prompts of 3-6 blocks; pairs share a 2-block prefix."""
    out = []
    for i in range(n):
        head = [start + i // 2] * (2 * BS)
        out.append(head + [start + 100 + i] * ((1 + i % 4) * BS) + [7])
    return out


async def workload(engine: MockerEngine, batch: list[list[int]]) -> None:
    for i, p in enumerate(batch):
        await run(engine, p, rank=i % 2)
    await engine.drain()


def truth(engine: MockerEngine, prompt: list[int]) -> dict[tuple[int, int], int]:
    """What each rank of the engine really caches of ``prompt`` (leading blocks)."""
    hashes = chain_hashes(prompt, BS)
    out = {}
    for sched in engine.ranks:
        n = len(sched.blocks.match_prefix(hashes))
        if n:
            out[(WID, sched.rank)] = n
    return out


def subscriber(zctx: Any, engine: MockerEngine, index: KvIndexer, replay: bool = True,
               metrics: RouterMetrics | None = None, **options: Any) -> KvEventSubscriber:
    cfg = engine.engine_config
    assert cfg is not None and cfg.kv_events_endpoint and cfg.kv_replay_endpoint
    sub = KvEventSubscriber(Resources("test"), WID, cfg.kv_events_endpoint, index,
                            replay_endpoint=cfg.kv_replay_endpoint if replay else None,
                            metrics=metrics, model="m", replay_timeout=2.0, **options)
    sub.start()
    return sub


async def caught_up(engine: MockerEngine, *subs: KvEventSubscriber) -> None:
    assert engine.publisher is not None
    last = engine.publisher.next_seq - 1
    for sub in subs:
        assert await sub.wait_for_seq(last, timeout=5), (sub, last, sub.stats)


async def live(engine: MockerEngine, sub: KvEventSubscriber) -> None:
    """Publish until the SUB socket provably receives live messages (ZMQ's slow joiner)."""
    assert engine.publisher is not None
    for i in range(200):
        await run(engine, [900 + i] * (BS + 1), rank=0, max_tokens=1)
        await sub.wait_for_seq(engine.publisher.next_seq - 1, timeout=0.05)
        if sub.stats.received:
            await caught_up(engine, sub)
            return
    raise AssertionError("the subscriber never received a live message")


def assert_index_is_exact(engine: MockerEngine, index: KvIndexer, batch: list[list[int]]) -> None:
    for p in batch:
        assert index.find_matches(p) == truth(engine, p), p


class Dropped:
    """Batches published in this block never leave the engine (as if PUB hit its HWM), but stay
    in its replay buffer."""

    def __init__(self, engine: MockerEngine) -> None:
        self.pub = engine.publisher

    def __enter__(self) -> None:
        assert self.pub is not None
        self.sock, self.pub._pub = self.pub._pub, None

    def __exit__(self, *exc: object) -> None:
        assert self.pub is not None
        self.pub._pub = self.sock


@pytest.fixture
async def engine() -> AsyncIterator[MockerEngine]:
    eng = await start_engine()
    yield eng
    await eng.cleanup()


async def test_events_reach_the_index_and_match_the_engine(zctx, engine):
    index = KvIndexer(BS)
    metrics = RouterMetrics()
    sub = subscriber(zctx, engine, index, metrics=metrics)
    try:
        await live(engine, sub)
        gaps = sub.stats.gaps  # the slow joiner's first messages may be lost (and replayed)
        batch = prompts(1, 12)
        await workload(engine, batch)
        await caught_up(engine, sub)
        assert_index_is_exact(engine, index, batch)
        assert {k for k in index.keys() if index.num_blocks(k)} == {(WID, 0), (WID, 1)}
        # Small cache (16 blocks a rank): some were evicted, and the index followed.
        assert any(truth(engine, p) == {} for p in batch) or index.stats.removed_blocks > 0
        assert (
            sub.stats.gaps == gaps
            and sub.stats.state_drops == 0
            and sub.stats.decode_errors == 0
        )
        text = metrics.render().decode()
        assert 'dynamo_router_kv_event_batches_total{model="m"}' in text
        assert 'dynamo_router_kv_event_lag_seconds_count{model="m"}' in text
    finally:
        await sub.close()
    assert index.keys() == set()  # closing drops the worker's state


async def test_a_late_subscriber_gets_the_full_state_in_a_dump(zctx, engine):
    batch = prompts(1, 8)
    await workload(engine, batch)  # before anyone subscribes
    index = KvIndexer(BS)
    sub = subscriber(zctx, engine, index)
    try:
        await caught_up(engine, sub)
        assert_index_is_exact(engine, index, batch)
        # Issue 18 (warm restart): a full dump, not a replay of the history from seq 0.
        assert sub.stats.snapshots == 1 and sub.stats.replays_ok == 0
        assert sub.stats.state_drops == 0
    finally:
        await sub.close()


async def test_a_late_subscriber_gets_every_held_block_however_old(zctx):
    """Warm restart (issue 18): the engine keeps 2 batches for replay and has evicted many
    blocks; a subscriber that starts now still indexes exactly what each rank holds."""
    engine = await start_engine(replay_buffer_size=2)
    try:
        batch = prompts(1, 24) + prompts(300, 6)  # far more than 16 blocks per rank: evictions
        await workload(engine, batch)
        assert engine.publisher is not None and engine.publisher.next_seq > 10
        index = KvIndexer(BS)
        sub = subscriber(zctx, engine, index)
        try:
            await caught_up(engine, sub)
            assert sub.stats.snapshots == 1 and sub.stats.state_drops == 0
            assert_index_is_exact(engine, index, batch)
            for sched in engine.ranks:
                held = len(sched.blocks.cached_hashes())
                assert 0 < index.num_blocks((WID, sched.rank)) <= held
            await workload(engine, prompts(500, 4))  # and it follows live from there
            await caught_up(engine, sub)
            assert_index_is_exact(engine, index, batch + prompts(500, 4))
        finally:
            await sub.close()
    finally:
        await engine.cleanup()


async def test_a_gap_closed_by_replay_restores_exactly_the_state_without_it(zctx, engine):
    index = KvIndexer(BS)
    sub = subscriber(zctx, engine, index)
    try:
        await live(engine, sub)
        await workload(engine, prompts(1, 6))
        await caught_up(engine, sub)
        before = (sub.stats.gaps, sub.stats.replays_ok)
        with Dropped(engine):  # stores and evictions the subscriber never sees live
            await workload(engine, prompts(50, 10))
        batch = prompts(1, 6) + prompts(50, 10) + prompts(200, 2)
        await workload(engine, prompts(200, 2))  # the next live batch reveals the gap
        await caught_up(engine, sub)
        assert (sub.stats.gaps, sub.stats.replays_ok) == (before[0] + 1, before[1] + 1)
        assert sub.stats.state_drops == 0
        assert_index_is_exact(engine, index, batch)
        # The same state as a subscriber that saw everything (from a full replay).
        reference = KvIndexer(BS)
        full = subscriber(zctx, engine, reference)
        await caught_up(engine, full)
        await full.close(drop_state=False)
        for p in batch:
            assert index.find_matches(p) == reference.find_matches(p)
        assert {k: index.num_blocks(k) for k in index.keys()} == {
            k: reference.num_blocks(k) for k in reference.keys()}
    finally:
        await sub.close()


async def test_without_replay_a_gap_drops_the_state_and_rebuilds_it(zctx, engine):
    index = KvIndexer(BS)
    metrics = RouterMetrics()
    sub = subscriber(zctx, engine, index, replay=False, metrics=metrics)
    try:
        await live(engine, sub)
        old = prompts(1, 4)
        await workload(engine, old)
        await caught_up(engine, sub)
        assert any(index.find_matches(p) for p in old)
        with Dropped(engine):
            await workload(engine, prompts(50, 4))
        new = [[300 + i] * (3 * BS) for i in range(4)]
        await workload(engine, new)
        await caught_up(engine, sub)
        assert sub.stats.gaps == 1 and sub.stats.state_drops == 1 and sub.stats.replays_failed == 0
        # Nothing from before the gap is trusted; what came after is indexed exactly.
        for p in old + prompts(50, 4):
            assert index.find_matches(p) == {}
        for p in new:
            assert index.find_matches(p) == truth(engine, p) != {}
        text = metrics.render().decode()
        assert 'dynamo_router_kv_event_gaps_total{model="m"} 1.0' in text
        assert 'dynamo_router_kv_state_drops_total{model="m"} 1.0' in text
    finally:
        await sub.close()


async def test_a_replay_that_cannot_reach_back_drops_the_state(zctx):
    engine = await start_engine(replay_buffer_size=3)
    index = KvIndexer(BS)
    sub = subscriber(zctx, engine, index)
    try:
        await live(engine, sub)
        await workload(engine, prompts(1, 4))
        await caught_up(engine, sub)
        drops = sub.stats.state_drops
        with Dropped(engine):
            await workload(engine, prompts(50, 8))  # far more batches than the buffer keeps
        await workload(engine, [[400] * (2 * BS)])
        await caught_up(engine, sub)
        assert sub.stats.replays_failed >= 1 and sub.stats.state_drops == drops + 1
        # Never more than the engine holds, whatever was lost.
        for p in prompts(1, 4) + prompts(50, 8) + [[400] * (2 * BS)]:
            got, real = index.find_matches(p), truth(engine, p)
            assert all(real.get(k, 0) >= n for k, n in got.items()), (p, got, real)
    finally:
        await sub.close()
        await engine.cleanup()


async def test_a_replay_over_its_byte_bound_fails_and_drops_the_state(zctx, engine):
    """A replay that brings more than ``max_replay_bytes`` is abandoned like one that times
    out: the gap stays open, so the worker's state is dropped, never half-trusted."""
    index = KvIndexer(BS)
    sub = subscriber(zctx, engine, index, max_replay_bytes=2_000)
    try:
        await live(engine, sub)
        await workload(engine, prompts(1, 2))
        await caught_up(engine, sub)
        drops, failed = sub.stats.state_drops, sub.stats.replays_failed
        with Dropped(engine):
            await workload(engine, prompts(50, 10))  # well over 2,000 bytes of batches
        await workload(engine, [[400] * (2 * BS)])
        await caught_up(engine, sub)
        assert sub.stats.replays_failed == failed + 1 and sub.stats.state_drops == drops + 1
        for p in prompts(1, 2) + prompts(50, 10) + [[400] * (2 * BS)]:
            got, real = index.find_matches(p), truth(engine, p)
            assert all(real.get(k, 0) >= n for k, n in got.items()), (p, got, real)
    finally:
        await sub.close()


async def test_undecodable_batches_are_counted_and_skipped(zctx):
    """A hand-made publisher (a real PUB socket, no replay): garbage in the middle is skipped
    without counting as a gap."""
    pub = zctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    index = KvIndexer(BS)
    sub = KvEventSubscriber(Resources("test"), WID, f"tcp://127.0.0.1:{port}", index)
    sub.start()
    seq = 0

    def send(payload: bytes) -> None:
        nonlocal seq
        pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), payload])
        seq += 1

    def stored(tokens: list[int], h: int) -> bytes:
        return encode_batch([BlockStored([h], None, tokens, BS)], 1)

    try:
        while sub.last_seq is None:  # slow joiner: until one arrives
            send(stored([1] * BS, 1))
            await asyncio.sleep(0.01)
        send(b"\x93not a batch")
        send(b"")
        pub.send_multipart([b"kv-events", b"short"])  # malformed frames: no seq to account
        send(stored([2] * BS, 2))
        assert await sub.wait_for_seq(seq - 1)
        assert sub.stats.decode_errors == 3 and sub.stats.gaps == 0
        assert index.find_matches([2] * BS) == {(WID, 1): 1}
    finally:
        await sub.close()
        pub.close(linger=0)


async def test_without_dumps_a_late_subscriber_replays_the_history_from_zero(zctx):
    """A hand-made publisher with vLLM's replay and no dumps: it answers the dump request with
    the end marker alone (no kept seq reaches that high), so the subscriber replays from 0."""
    pub = zctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    replay = zctx.socket(zmq.ROUTER)
    replay.setsockopt(zmq.LINGER, 0)
    replay_port = replay.bind_to_random_port("tcp://127.0.0.1")
    kept = [(seq, encode_batch([BlockStored([seq + 1], seq or None, [seq + 1] * BS, BS)], 0))
            for seq in range(3)]  # a chain of three blocks, one per batch
    asked: list[int] = []

    async def serve() -> None:
        while True:
            if not replay.poll(0):
                await asyncio.sleep(0.005)
                continue
            ident, _, start_frame = replay.recv_multipart()
            start = int.from_bytes(start_frame, "big")
            asked.append(start)
            for seq, payload in kept:
                if seq >= start:
                    replay.send_multipart([ident, b"", b"kv-events", seq.to_bytes(8, "big"),
                                           payload])
            replay.send_multipart([ident, b"", b"", b"\xff" * 8, b""])

    server = asyncio.create_task(serve())
    index = KvIndexer(BS)
    sub = KvEventSubscriber(Resources("test"), WID, f"tcp://127.0.0.1:{port}", index,
                            replay_endpoint=f"tcp://127.0.0.1:{replay_port}")
    sub.start()
    try:
        assert await sub.wait_for_seq(2)
        assert asked[:2] == [0xFFFFFFFFFFFFFFFE, 0]
        assert sub.stats.snapshots == 0 and sub.stats.replays_ok == 1
        assert index.find_matches([1] * BS + [2] * BS + [3] * BS) == {(WID, 0): 3}
    finally:
        await sub.close()
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server
        pub.close(linger=0)
        replay.close(linger=0)


async def test_odd_batch_timestamps_never_poison_the_event_lag_metric(zctx):
    pub = zctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    index, metrics = KvIndexer(BS), RouterMetrics()
    sub = KvEventSubscriber(
        Resources("test"), WID, f"tcp://127.0.0.1:{port}", index, metrics=metrics, model="m"
    )
    sub.start()
    seq = 0

    def send(ts: float, h: int) -> None:
        nonlocal seq
        batch = msgspec.msgpack.encode([ts, [{"type": "BlockStored", "block_hashes": [h],
                                              "parent_block_hash": None, "token_ids": [h] * BS,
                                              "block_size": BS}], 0])
        pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), batch])
        seq += 1

    try:
        while sub.last_seq is None:  # slow joiner: until one arrives
            send(time.time(), 1)
            await asyncio.sleep(0.01)
        assert await sub.wait_for_seq(seq - 1)
        applied = sub.stats.applied
        for i, ts in enumerate([math.nan, math.inf, -math.inf, 1e300, -1e300, time.time() + 60]):
            send(ts, 2 + i)
        assert await sub.wait_for_seq(seq - 1)
        assert sub.stats.applied == applied + 6 and sub.stats.decode_errors == 0
        text = metrics.render().decode()
        total = next(line for line in text.splitlines()
                     if line.startswith("dynamo_router_kv_event_lag_seconds_sum"))
        assert math.isfinite(float(total.split()[-1])), total
    finally:
        await sub.close()
        pub.close(linger=0)


async def test_an_oversized_batch_is_skipped_undecoded(zctx):
    """A batch over ``max_batch_bytes`` is counted and skipped like an undecodable one (never a
    gap): its blocks, and children chained to them, stay out of the index; the rest goes on."""
    pub = zctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    index = KvIndexer(BS)
    sub = KvEventSubscriber(
        Resources("test"), WID, f"tcp://127.0.0.1:{port}", index, max_batch_bytes=64 << 10
    )
    sub.start()
    seq = 0

    def send(blocks: list[int], tokens: list[int], parent: int | None = None) -> None:
        nonlocal seq
        pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"),
                            encode_batch([BlockStored(blocks, parent, tokens, BS)], 1)])
        seq += 1

    try:
        while sub.last_seq is None:  # slow joiner: until one arrives
            send([1], [1] * BS)
            await asyncio.sleep(0.01)
        n = 40_000  # ~470 KiB of token ids
        send(list(range(100, 100 + n)), [300] * (n * BS))
        send([7], [7] * BS, parent=100 + n - 1)  # chained to the skipped batch
        send([3], [3] * BS)
        assert await sub.wait_for_seq(seq - 1)
        assert sub.stats.decode_errors == 1 and sub.stats.gaps == 0 and sub.running
        assert index.find_matches([300] * BS) == {}
        assert index.find_matches([300] * (n * BS) + [7] * BS) == {}
        assert index.find_matches([3] * BS) == {(WID, 1): 1}
        assert index.stats.unknown_parent == 1
    finally:
        await sub.close()
        pub.close(linger=0)


async def test_a_killed_worker_leaves_the_routers_index(namespace, spawn, make_runtime, tiny_model):
    """Real worker processes: the router subscribes to each; SIGKILL one and its blocks go."""
    procs = [spawn("-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path", str(tiny_model),
                   "--model-name", "tiny", "--namespace", namespace, "--host", "127.0.0.1",
                   "--block-size", "16", "--speedup-ratio", "1000", ready=False) for _ in range(2)]
    for p in procs:
        p.wait_ready()
    rt = make_runtime()
    client = await rt.endpoint(f"{namespace}.backend.generate").client()
    router = await KvRouter(client, 16, runtime=rt, model="tiny").start()
    try:
        ids = {p.instance_id for p in procs}
        assert await until(client, lambda: set(router.followed()) == ids, 15)
        prompt = list(range(10, 90))  # 5 blocks
        for tail in ([1], [2]):  # route twice: the second lands where the first cached it
            stream = await router.generate(
                PreprocessedRequest(prompt + tail, stop=StopConditions(max_tokens=2))
            )
            [_ async for _ in stream]
            first = stream.instance_id
            assert await until(client, lambda: router.best_worker(prompt).overlap_blocks == 5, 10)
        assert {k[0] for k in router.indexer.keys() if router.indexer.num_blocks(k)} >= {first}
        victim = next(p for p in procs if p.instance_id == first)
        victim.signal(signal.SIGKILL)
        victim.wait()
        assert await until(client, lambda: first not in router.followed(), 10)
        assert all(k[0] != first for k in router.indexer.keys())
        assert router.best_worker(prompt).overlap_blocks == 0
        assert router.loads.candidates() == [] or all(
            k[0] != first for k in router.loads.candidates()
        )
        # Still served by the other worker.
        stream = await router.generate(
            PreprocessedRequest(prompt, stop=StopConditions(max_tokens=2))
        )
        assert stream.instance_id != first and [_ async for _ in stream]
    finally:
        await router.close()
