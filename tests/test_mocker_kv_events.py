"""The mocker's KV events on real ZMQ sockets, decoded with the reference ``msgpack`` package:
vLLM's frames and payload shape, gap-free sequence numbers, hashes that chain and that the
events account for exactly, and vLLM's replay protocol."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from dynamo_zmq.context import Context
from dynamo_zmq.llm import PreprocessedRequest, RoutingHints, StopConditions
from engines.mocker import MockerConfig, MockerEngine
from engines.mocker._hashing import block_hash
from router.hashing import block_hashes
from tests.support.fixtures import VLLM_KV_EVENTS, vllm_kv_events

FIXTURES = VLLM_KV_EVENTS
TOPIC = b"kv-events"
END = [b"", b"", b"\xff" * 8, b""]
BS = 4
STORED_KEYS = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
               "medium", "lora_name", "extra_keys"}
#: vLLM's keys, then the router's own hashes (issue 18: the mocker hashes at the edge).
MOCKER_STORED_KEYS = STORED_KEYS | {"own_hashes"}


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def start_engine(**overrides: Any) -> MockerEngine:
    base: dict[str, Any] = {"speedup_ratio": 1e6, "host": "127.0.0.1", "block_size": BS,
                            "num_gpu_blocks": 24, "vocab_size": 1000,
                            "kv_event_form": "stores"}  # vLLM's event shape
    engine = MockerEngine(MockerConfig(**{**base, **overrides}))
    await engine.start(worker_id=1)
    return engine


async def run(
    engine: MockerEngine, prompt: list[int], rank: int | None = None, max_tokens: int = 6
) -> None:
    req = PreprocessedRequest(prompt, stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
                              routing=RoutingHints(dp_rank=rank))
    chunks = [c async for c in engine.generate(req, Context())]
    assert chunks[-1].finish_reason == "length"


async def subscribed(zctx: zmq.asyncio.Context, engine: MockerEngine) -> zmq.asyncio.Socket:
    """A SUB socket that provably receives: warm-up requests publish until one batch arrives."""
    assert engine.engine_config is not None and engine.engine_config.kv_events_endpoint
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sub.connect(engine.engine_config.kv_events_endpoint)
    for i in range(500):
        await run(engine, [500 + i % 400] * (2 * BS + 1), rank=0, max_tokens=1)
        if await sub.poll(20):
            return sub
    raise AssertionError("the SUB socket never received a batch")


async def recv_until(sub: zmq.asyncio.Socket, last_seq: int) -> list[list[bytes]]:
    """Every message up to and including seq ``last_seq``."""
    got: list[list[bytes]] = []
    while True:
        frames = await asyncio.wait_for(sub.recv_multipart(), 5)
        got.append(frames)
        if int.from_bytes(frames[1], "big") >= last_seq:
            return got


async def replay(zctx: zmq.asyncio.Context, endpoint: str, start: int) -> list[list[bytes]]:
    """Ask the replay socket for everything from ``start``; returns the messages before the end
    marker."""
    dealer = zctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got: list[list[bytes]] = []
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), 5)
            if frames == END:
                return got
            got.append(frames)
    finally:
        dealer.close(linger=0)


async def workload(engine: MockerEngine) -> None:
    """Shared prefixes, distinct suffixes, both ranks, more blocks than fit: stores and
    evictions."""
    prefixes = [[p * 10 + k for k in range(3 * BS)] for p in range(1, 5)]
    reqs = [run(engine, [*prefixes[i % 4], *range(200 + 7 * i, 200 + 7 * i + 5)], rank=i % 2)
            for i in range(24)]
    for batch in range(0, 24, 6):
        await asyncio.gather(*reqs[batch : batch + 6])
    await engine.drain()


def check_history(messages: list[list[bytes]], engine: MockerEngine) -> dict[str, int]:
    """Validate a gap-free history from seq 0; returns counts of what it saw."""
    live: dict[int, set[int]] = {0: set(), 1: set()}
    ever: dict[int, set[int]] = {0: set(), 1: set()}
    seen = {"stored": 0, "removed": 0, "chained": 0}
    own_of: dict[int, int] = {}  # engine hash -> the router's hash published with it
    for expect_seq, frames in enumerate(messages):
        topic, seq, payload = frames
        assert topic == TOPIC and len(seq) == 8 and int.from_bytes(seq, "big") == expect_seq
        batch = msgpack.unpackb(payload)
        assert isinstance(batch, list) and len(batch) == 3
        ts, events, rank = batch
        assert isinstance(ts, float) and isinstance(events, list) and events and rank in (0, 1)
        for ev in events:
            if ev["type"] == "BlockStored":
                assert set(ev) == MOCKER_STORED_KEYS
                assert ev["block_size"] == BS and ev["medium"] == "GPU"
                assert ev["lora_id"] is None and ev["lora_name"] is None
                hashes, tokens, parent = (
                    ev["block_hashes"], ev["token_ids"], ev["parent_block_hash"]
                )
                assert hashes and len(tokens) == BS * len(hashes)
                # Hashed at the edge: exactly what the router computes from the tokens.
                own = block_hashes(tokens, BS, None if parent is None else own_of[parent])
                assert ev["own_hashes"] == own
                own_of.update(zip(hashes, own, strict=True))
                if parent is not None:
                    assert parent in ever[rank], "parent_block_hash was never stored"
                    seen["chained"] += 1
                for i, h in enumerate(hashes):
                    assert isinstance(h, int) and 0 <= h < 2**64
                    assert block_hash(
                        parent if i == 0 else hashes[i - 1], tokens[i * BS : (i + 1) * BS]
                    ) == h
                    assert h not in live[rank], "stored twice without a removal"
                    live[rank].add(h)
                    ever[rank].add(h)
                seen["stored"] += len(hashes)
            elif ev["type"] == "BlockRemoved":
                assert set(ev) == {"type", "block_hashes", "medium"}
                for h in ev["block_hashes"]:
                    assert h in live[rank], "removed a hash that is not stored"
                    live[rank].remove(h)
                seen["removed"] += len(ev["block_hashes"])
            else:
                assert ev == {"type": "AllBlocksCleared"}
                live[rank].clear()
    for rank, sched in enumerate(engine.ranks):
        assert live[rank] == set(sched.blocks.cached_hashes()), "events and cache state disagree"
    return seen


async def test_events_follow_vllms_format_and_account_for_the_cache(
    zctx: zmq.asyncio.Context,
) -> None:
    engine = await start_engine(data_parallel_size=2)
    try:
        sub = await subscribed(zctx, engine)
        await workload(engine)
        assert engine.publisher is not None
        last = engine.publisher.next_seq - 1
        live = await recv_until(sub, last)
        # Live messages: three frames, consecutive seqs up to the last published.
        seqs = [int.from_bytes(f[1], "big") for f in live]
        assert all(len(f) == 3 and f[0] == TOPIC for f in live)
        assert seqs == list(range(seqs[0], last + 1))
        # The whole history (replayed from 0) is consistent, and matches what was live.
        assert engine.engine_config is not None and engine.engine_config.kv_replay_endpoint
        history = [f[1:] for f in await replay(zctx, engine.engine_config.kv_replay_endpoint, 0)]
        assert len(history) == last + 1
        assert history[seqs[0] :] == live
        seen = check_history(history, engine)
        assert seen["stored"] > 0 and seen["removed"] > 0 and seen["chained"] > 0
        assert {msgpack.unpackb(f[2])[2] for f in history} == {0, 1}
        # A reset of the idle cache is one more batch per rank: AllBlocksCleared.
        assert engine.reset_prefix_cache()
        cleared = await recv_until(sub, last + 2)
        assert [msgpack.unpackb(f[2])[1] for f in cleared] == [[{"type": "AllBlocksCleared"}]] * 2
    finally:
        await engine.cleanup()


async def test_replay_returns_the_buffered_batches_from_a_seq(zctx: zmq.asyncio.Context) -> None:
    engine = await start_engine(replay_buffer_size=5)
    try:
        assert engine.engine_config is not None and engine.publisher is not None
        endpoint = engine.engine_config.kv_replay_endpoint
        assert endpoint is not None
        for i in range(8):
            await run(engine, [i + 1] * (BS + 1), max_tokens=1)  # one stored block each
        await engine.drain()
        total = engine.publisher.next_seq
        assert total >= 8
        for start in (total - 3, total - 5):
            got = await replay(zctx, endpoint, start)
            assert all(len(f) == 4 and f[0] == b"" and f[1] == TOPIC for f in got)
            assert [int.from_bytes(f[2], "big") for f in got] == list(range(start, total))
            assert all(msgpack.unpackb(f[3])[1][0]["type"] == "BlockStored" for f in got)
        # Older than the buffer: what is still kept; nothing newer: just the end marker.
        assert [int.from_bytes(f[2], "big") for f in await replay(zctx, endpoint, 0)] == list(
            range(total - 5, total))
        assert await replay(zctx, endpoint, total) == []
    finally:
        await engine.cleanup()


async def test_malformed_replay_requests_are_ignored(zctx: zmq.asyncio.Context) -> None:
    engine = await start_engine()
    try:
        assert engine.engine_config is not None and engine.engine_config.kv_replay_endpoint
        await run(engine, [1] * (BS + 1), max_tokens=1)
        dealer = zctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(engine.engine_config.kv_replay_endpoint)
        await dealer.send_multipart([b"", b"short"])
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        first = await asyncio.wait_for(dealer.recv_multipart(), 5)
        assert first[:2] == [b"", TOPIC] and int.from_bytes(first[2], "big") == 0
        dealer.close(linger=0)
    finally:
        await engine.cleanup()


async def test_no_events_without_prefix_caching_or_when_disabled(zctx: zmq.asyncio.Context) -> None:
    engine = await start_engine(enable_prefix_caching=False)
    try:
        await run(engine, list(range(1, 30)))
        assert engine.publisher is not None and engine.publisher.next_seq == 0
    finally:
        await engine.cleanup()
    off = await start_engine(enable_kv_events=False)
    try:
        await run(off, list(range(1, 30)))
        assert off.publisher is None and off.engine_config is not None
        assert off.engine_config.kv_events_endpoint is None
    finally:
        await off.cleanup()


def test_payload_shape_matches_a_real_vllm_capture() -> None:
    vllm_kv_events()  # fails clearly when the captures are missing
    real = msgpack.unpackb((FIXTURES / "batch_seq0006.msgpack").read_bytes())
    real_stored = next(e for e in real[1] if e["type"] == "BlockStored")
    real_removed = next(e for e in real[1] if e["type"] == "BlockRemoved")
    from engines.mocker._kv_events import BlockRemoved, BlockStored, encode_batch

    ours = msgpack.unpackb(
        encode_batch([BlockRemoved([7]), BlockStored([1, 2], 9, list(range(64)), 32)], 0)
    )
    assert [type(x) for x in ours] == [type(x) for x in real]
    removed, stored = ours[1]
    assert list(stored)[: len(STORED_KEYS)] == list(real_stored)[: len(STORED_KEYS)]
    assert set(removed) <= set(real_removed)
    for key in STORED_KEYS:
        assert (
            type(stored[key]) is type(real_stored[key])
            or real_stored[key] is None
            or stored[key] is None
        )


def test_the_dump_stores_parents_first_even_after_a_parent_was_stored_again() -> None:
    """A parent evicted and stored again comes after its children in insertion order; the
    dump still stores it first, so an index fed only the dump matches the whole chain."""
    from engines.mocker._kv_events import BlockRemoved, BlockStored
    from engines.mocker._kv_mirror import KvStateMirror
    from router.events import decode_batch, encode_batch
    from router.indexer import KvIndexer

    bs = 2
    mirror = KvStateMirror()
    mirror.apply([BlockStored([11, 12, 13], None, [1, 1, 2, 2, 3, 3], bs)], 0)
    mirror.apply([BlockStored([21], None, [9, 9], bs)], 1)
    mirror.apply([BlockRemoved([11, 21])], 0)
    mirror.apply([BlockRemoved([21])], 1)
    mirror.apply([BlockStored([11], None, [1, 1], bs)], 0)
    index = KvIndexer(bs)
    for rank, events in mirror.snapshot():
        index.apply_batch(7, decode_batch(encode_batch(events, rank)))
    assert index.find_matches([1, 1, 2, 2, 3, 3]) == {(7, 0): 3}
    assert index.find_matches([9, 9]) == {}
    assert mirror.num_blocks(0) == 3 and mirror.num_blocks(1) == 0
