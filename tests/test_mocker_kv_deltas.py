"""The mocker's own-hash deltas (issue 18, item 1) through real processes: two mocker workers get
the same requests, one publishing ``--kv-event-form deltas`` (the default) and one ``stores``.
A ZMQ SUB and replay DEALER in the test decode the deltas worker's ``OwnBatch`` payloads with
msgspec: the own hashes its live deltas leave held equal its full dump's (``SNAPSHOT_SEQ``), the
stores worker's (own hashes of its ``BlockStored`` events, minus its removals), and, before any
eviction, exactly the router's hashes of the prompts' blocks; replays are the live batches."""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from dynamo_zmq.llm import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    OwnBatch,
    OwnRemoved,
    OwnStored,
)
from engines.mocker._publisher import SNAPSHOT_SEQ
from router.hashing import block_hashes
from tests.support.completions import complete_header
from tests.support.mocker_fleet import serving, start_frontend, start_mocker
from tests.support.procs import Proc
from tests.support.waiting import eventually

BLOCK = 16
END_SEQ = b"\xff" * 8
own_decoder = msgspec.msgpack.Decoder(OwnBatch)
stores_decoder = msgspec.msgpack.Decoder(EventBatch)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Feed:
    """One worker's KV events: a SUB from the start, the replay socket's endpoint."""

    def __init__(self, zctx: zmq.asyncio.Context, events: int, replay: int) -> None:
        self.zctx = zctx
        self.replay_endpoint = f"tcp://127.0.0.1:{replay}"
        self.sub = zctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(f"tcp://127.0.0.1:{events}")
        self.live: dict[int, bytes] = {}

    def drain(self) -> None:
        while True:
            try:  # (zmq.asyncio: a future, already settled with NOBLOCK)
                topic, seq, payload = self.sub.recv_multipart(zmq.NOBLOCK).result()
            except zmq.Again:
                return
            assert topic == b"kv-events"
            self.live[int.from_bytes(seq, "big")] = payload

    async def replay(self, start: int) -> list[tuple[int, bytes]]:
        dealer = self.zctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out = []
            while True:
                _, _topic, seq, payload = await asyncio.wait_for(dealer.recv_multipart(), 10)
                if seq == END_SEQ:
                    return out
                out.append((int.from_bytes(seq, "big"), payload))
        finally:
            dealer.close(0)


def held_from_deltas(payloads: list[bytes]) -> tuple[set[int], int]:
    """Own hashes the deltas leave held, and the last ``holes``; checks the contract."""
    held: set[int] = set()
    holes = 0
    for payload in payloads:
        for ev in own_decoder.decode(payload).events:
            if isinstance(ev, OwnStored):
                assert held.isdisjoint(ev.own_hashes), "stored own hashes are new to the rank"
                held.update(ev.own_hashes)
                holes = ev.holes
            elif isinstance(ev, OwnRemoved):
                assert held.issuperset(ev.own_hashes), "removed own hashes were held"
                held.difference_update(ev.own_hashes)
                holes = ev.holes
            else:
                held.clear()
                holes = 0
    return held, holes


def held_from_stores(payloads: list[bytes]) -> set[int]:
    """Own hashes of the blocks the stores-form events leave held."""
    own_of: dict[int, int] = {}
    for payload in payloads:
        for ev in stores_decoder.decode(payload).events:
            if isinstance(ev, BlockStored):
                assert ev.own_hashes is not None
                own_of.update(zip(ev.block_hashes, ev.own_hashes, strict=True))
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    own_of.pop(h, None)
            elif isinstance(ev, AllBlocksCleared):
                own_of.clear()
    return set(own_of.values())


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


def _worker(spawn: Callable[..., Proc], namespace: str, model: Any, form: str | None,
            ports: tuple[int, int]) -> Proc:
    extra = [] if form is None else ["--kv-event-form", form]
    return start_mocker(spawn, namespace, model, "--block-size", str(BLOCK),
                        "--num-gpu-blocks-override", "20", "--kv-events-port", str(ports[0]),
                        "--kv-replay-port", str(ports[1]), *extra)


async def test_deltas_replay_to_the_dump_and_to_the_stores_forms_state(
    namespace: str, spawn: Callable[..., Proc], tiny_model: Any, zctx: zmq.asyncio.Context
) -> None:
    ports = [(_free_port(), _free_port()) for _ in range(2)]
    deltas_w = _worker(spawn, namespace, tiny_model, "deltas", ports[0])
    stores_w = _worker(spawn, namespace, tiny_model, "stores", ports[1])
    front = start_frontend(spawn, namespace, mode="direct")
    await serving(front, [deltas_w, stores_w])
    deltas, stores = Feed(zctx, *ports[0]), Feed(zctx, *ports[1])
    await asyncio.sleep(0.5)  # the SUBs join; a missed batch is checked against the replay

    rng = random.Random(18)
    shared = [rng.randrange(10, 500) for _ in range(2 * BLOCK)]
    prompts = [shared + [rng.randrange(10, 500) for _ in range(4 * BLOCK + 3)] for _ in range(6)]
    expected: set[int] = set()

    async def same_state() -> bool:
        deltas.drain()
        stores.drain()
        return (held_from_deltas(list(deltas.live.values()))[0] == expected
                == held_from_stores(list(stores.live.values())))

    for i, prompt in enumerate(prompts):
        for w in (deltas_w, stores_w):
            await asyncio.to_thread(complete_header, front.address, prompt, w.instance_id)
        if i < 3:  # 2 + 3 x 4 = 14 blocks fit in 20: nothing evicted yet
            expected |= set(block_hashes(prompt, BLOCK))
            await eventually(same_state, 15, f"prompt {i}'s own hashes published in both forms")

    async def settled() -> bool:
        deltas.drain()
        stores.drain()
        live = held_from_deltas([deltas.live[s] for s in sorted(deltas.live)])[0]
        return bool(live) and live == held_from_stores([stores.live[s]
                                                         for s in sorted(stores.live)])

    await eventually(settled, 15, "the evicting prompts published in both forms")
    replayed = await deltas.replay(0)
    assert [s for s, _ in replayed] == list(range(len(replayed)))
    for seq, payload in replayed:  # replays are the very delta batches published live
        if seq in deltas.live:
            assert deltas.live[seq] == payload
    held, holes = held_from_deltas([p for _, p in replayed])
    assert held < expected | {h for p in prompts for h in block_hashes(p, BLOCK)}
    assert held == held_from_stores([p for _, p in await stores.replay(0)])

    dump = await deltas.replay(SNAPSHOT_SEQ)
    assert dump and {s for s, _ in dump} == {len(replayed) - 1}
    dump_events = [ev for _, p in dump for ev in own_decoder.decode(p).events]
    assert all(isinstance(ev, OwnStored) for ev in dump_events)  # preceded by nothing
    assert held_from_deltas([p for _, p in dump]) == (held, holes)
