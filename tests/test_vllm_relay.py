"""The vLLM adapter's KV relay (``engines/vllm/_relay.py``) with auth off (issue 18, items 1 and
5): it runs whenever KV events are on, republishes vLLM's events hashed at the edge in the
configured form on plaintext sockets, and answers full dumps (``SNAPSHOT_SEQ``) from its own
record instead of vLLM's end marker, so a kv-mode frontend started after a real vLLM worker
cached a prompt gets the worker's state in a dump and routes the prompt's prefix to it.

Runs only where vLLM is installed; skipped otherwise, except in CI (``CI=true``)."""

from __future__ import annotations

import asyncio
import json
import random
import re
import socket
from pathlib import Path

import msgspec

import tests.support.needs_vllm  # noqa: F401  (skips this module without vLLM; fails it in CI)

# isort: split

import zmq

from dynamo_zmq.llm import AllBlocksCleared, BlockStored, EventBatch, OwnBatch, OwnStored
from router.hashing import block_hashes
from tests.support.completions import complete_header
from tests.support.http_calls import get
from tests.support.metrics import index_blocks
from tests.support.vllm_stack import VLLM_ENV, WORKER_FLAGS, WORKER_START
from tests.support.waiting import eventually, serving

SNAPSHOT_SEQ = 0xFFFFFFFFFFFFFFFE
END_SEQ = b"\xff" * 8


def _ask(endpoint: str, start: int) -> list[list[bytes]]:
    """A replay request over plaintext: every answer up to and without the end marker."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    try:
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while dealer.poll(5000):
            frames = dealer.recv_multipart()
            if frames[1] == b"":
                assert frames[2] == END_SEQ
                return got
            got.append(frames)
        raise AssertionError(f"no end marker after {got[-3:]}")
    finally:
        dealer.close(0)
        ctx.term()


def _live(endpoint: str) -> list[bytes]:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.linger = 0
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        assert sub.poll(5000), "no live batch over plaintext"
        return sub.recv_multipart()
    finally:
        sub.close(0)
        ctx.term()


def _relay_child(spawn, tmp_path: Path, form: str) -> dict:
    out = tmp_path / "ports.json"
    child = spawn("-m", "tests.support.vllm_relay_child", "-", "worker", str(out), form,
                  ready=False)
    child.wait_ready(180)  # importing vLLM takes a while
    ports = json.loads(out.read_text())
    assert ports["vllm_events"].startswith("tcp://127.0.0.1:")  # vLLM's own stay on loopback
    return ports


def test_without_auth_the_relay_dumps_its_stores_and_replays_vllms(spawn, tmp_path: Path) -> None:
    ports = _relay_child(spawn, tmp_path, "stores")
    own = block_hashes([1, 2], 2)
    topic, _seq, payload = _live(f"tcp://127.0.0.1:{ports['pub']}")
    (stored,) = msgspec.msgpack.decode(payload, type=EventBatch).events
    assert topic == b"kv-events" and isinstance(stored, BlockStored)
    assert stored.own_hashes == own

    replay = f"tcp://127.0.0.1:{ports['replay']}"
    dump = _ask(replay, SNAPSHOT_SEQ)
    assert dump, "the relay answers a full dump (vLLM would send the end marker alone)"
    events = [ev for f in dump for ev in msgspec.msgpack.decode(f[3], type=EventBatch).events]
    assert isinstance(events[0], AllBlocksCleared)
    stores = events[1:]
    assert stores and all(isinstance(ev, BlockStored) and ev.own_hashes == own for ev in stores)
    held = {h for ev in stores for h in ev.block_hashes}  # type: ignore[union-attr]
    last = int.from_bytes(dump[0][2], "big")
    assert held == set(range(1, last + 2))  # batch i stored engine block i + 1
    answers = _ask(replay, 0)  # vLLM's own replay, passed on: its payloads, no own hashes
    seqs = [int.from_bytes(a[2], "big") for a in answers]
    assert answers and seqs == sorted(seqs)
    replayed = [ev for a in answers for ev in msgspec.msgpack.decode(a[3], type=EventBatch).events]
    assert all(isinstance(ev, BlockStored) and ev.own_hashes is None for ev in replayed)


def test_in_deltas_form_live_replays_and_dumps_are_own_batches(spawn, tmp_path: Path) -> None:
    ports = _relay_child(spawn, tmp_path, "deltas")
    own = block_hashes([1, 2], 2)
    decoder = msgspec.msgpack.Decoder(OwnBatch)
    _live(f"tcp://127.0.0.1:{ports['pub']}")
    replay = f"tcp://127.0.0.1:{ports['replay']}"
    answers = _ask(replay, 0)
    seqs = [int.from_bytes(a[2], "big") for a in answers]
    assert seqs == list(range(len(seqs))) and len(seqs) >= 1
    events = [ev for a in answers for ev in decoder.decode(a[3]).events]
    assert events == [OwnStored(own, 0)]  # the later stores of the same own hash change nothing
    dump = _ask(replay, SNAPSHOT_SEQ)
    assert [ev for f in dump for ev in decoder.decode(f[3]).events] == [OwnStored(own, 0)]


def _snapshot_count(url: str) -> float:
    text = get(f"{url}/metrics")[1].decode()
    found = re.search(
        r'^dynamo_router_kv_event_replays_total\{[^}]*result="snapshot"[^}]*\} (\S+)$', text,
        re.MULTILINE)
    return float(found.group(1)) if found else 0.0


async def test_a_frontend_started_later_routes_a_vllm_workers_prefix_to_it(
    spawn, tiny_model, namespace
) -> None:
    """Item 5 with real vLLM: the prompt was cached before the kv-mode frontend started; it gets
    the worker's blocks in the relay's dump and routes the prefix to it, not to a mocker."""
    block = 32  # vLLM's block size on the CPU
    w = spawn("-m", "dynamo_zmq.worker", "--engine", "vllm", "--model-path", str(tiny_model),
              "--model-name", "tiny", "--namespace", namespace, "--host", "127.0.0.1",
              *WORKER_FLAGS, env=VLLM_ENV, ready=False)
    other = spawn("-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path",
                  str(tiny_model), "--model-name", "tiny", "--namespace", namespace,
                  "--host", "127.0.0.1", "--block-size", str(block), "--speedup-ratio", "1000",
                  ready=False)
    first = spawn("-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace", namespace,
                  "--router-mode", "direct", ready=False)
    w.wait_ready(WORKER_START)
    other.wait_ready()
    first.wait_ready(60)
    await serving(first, [w, other], timeout=60)
    rng = random.Random(5)
    prompt = [rng.randrange(10, 500) for _ in range(4 * block + 3)]
    await asyncio.to_thread(complete_header, first.address, prompt, w.instance_id)
    await asyncio.sleep(1)  # the relay follows the stores (vLLM publishes them after the step)

    front = spawn("-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace", namespace,
                  "--router-mode", "kv", ready=False).wait_ready(60)
    await serving(front, [w, other], timeout=60)

    async def indexed() -> bool:  # without any request through this frontend
        return (await index_blocks(front.address)).get(f"{w.instance_id:x}", 0) >= 4

    await eventually(indexed, 20, "the vLLM worker's cached prompt in the new index")
    assert await asyncio.to_thread(_snapshot_count, front.address) >= 1
    got = await asyncio.to_thread(complete_header, front.address, [*prompt[:-3], 7, 8, 9])
    assert got == f"{w.instance_id:x}/0"


async def test_a_taken_loopback_port_for_vllm_is_picked_again_and_replays_reach_it(
    tiny_model,
) -> None:
    """The relay's loopback port for vLLM's replay socket was picked free and taken by another
    process before vLLM bound it, and a worker failed to start (a CI run of round 28). Now
    ``start_llm`` sees the port in use, the relay picks fresh loopback ports and the second
    attempt starts. The part of vLLM that binds them is its own ``ZmqEventPublisher`` (what its
    engine core makes from ``kv_events_config``). Replays the relay passes on reach vLLM at the
    new port."""
    from vllm.distributed.kv_events import BlockStored as VllmBlockStored
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

    from dynamo_zmq.resources import Resources
    from engines.vllm import VllmOptions
    from engines.vllm._config import build_engine_args, relay_for
    from engines.vllm._start import kv_ports, start_llm

    res = Resources("test-relay")
    opts = VllmOptions(kv_event_form="stores")
    given = {"model": str(tiny_model)}
    relay = relay_for(given, opts, res)
    assert relay is not None
    first = relay.vllm_replay
    taken = socket.socket()  # another process got there first
    taken.bind(("127.0.0.1", int(first.rpartition(":")[2])))
    taken.listen()
    publishers: list[ZmqEventPublisher] = []

    def build() -> tuple[object, tuple[int, ...]]:
        args = build_engine_args(given, opts, True, relay)
        return args, kv_ports(args)

    def create(args) -> ZmqEventPublisher:
        cfg = args.kv_events_config
        pub = ZmqEventPublisher(0, endpoint=cfg.endpoint, replay_endpoint=cfg.replay_endpoint,
                                topic=cfg.topic)
        publishers.append(pub)
        return pub

    def prepare() -> None:
        if not relay.started:
            relay.start()

    try:
        pub = await start_llm(build, create, prepare=prepare, repick=relay.repick,
                              port_wait=0.5)
        assert relay.vllm_replay != first and pub._replay_endpoint == relay.vllm_replay
        await asyncio.sleep(0.5)  # vLLM's PUB connects to the relay's SUB
        stored = VllmBlockStored(block_hashes=[7], parent_block_hash=None, token_ids=[1, 2],
                                 block_size=2, lora_id=None, medium=None, lora_name=None)
        pub.publish(KVEventBatch(ts=0.0, events=[stored]))
        replay = f"tcp://127.0.0.1:{relay.replay_ports[0]}"
        answers: list[list[bytes]] = []
        for _ in range(50):  # until vLLM's buffer holds the batch
            answers = await asyncio.to_thread(_ask, replay, 0)
            if answers:
                break
            await asyncio.sleep(0.1)
        replayed = [ev for a in answers
                    for ev in msgspec.msgpack.decode(a[3], type=EventBatch).events]
        assert [ev.block_hashes for ev in replayed] == [[7]]  # type: ignore[union-attr]
    finally:
        for p in publishers:
            p.shutdown()
        taken.close()
        await res.close()
