"""Warm restart through real processes: mocker workers cache prefixes (and evict some) before a
kv-mode frontend or ``python -m router`` starts; the new router gets each worker's full state in
a dump on subscribe and routes every cached prefix to its worker at once, while the evicted ones
match nowhere. The workers keep only 2 batches for replay, so no window of recent events could
bring the state: only the dump can."""

from __future__ import annotations

import asyncio
import random

from prometheus_client.parser import text_string_to_metric_families

from tests.support.completions import complete_header
from tests.support.http_calls import get
from tests.support.metrics import index_blocks
from tests.support.mocker_fleet import serving, start_frontend, start_mocker
from tests.support.procs import Proc
from tests.support.waiting import eventually

BLOCK = 16
PREFIX_BLOCKS = 6


def worker(spawn, namespace, model_dir, blocks: int) -> Proc:
    return start_mocker(spawn, namespace, model_dir, "--block-size", str(BLOCK),
                        "--num-gpu-blocks-override", str(blocks), "--kv-replay-buffer-size", "2")


async def test_a_new_router_routes_prefixes_cached_before_it_started(
    namespace, spawn, make_runtime, tiny_model
):
    # w1 holds 24 blocks: of five 7-block requests, the first's blocks are evicted.
    w1, w2 = worker(spawn, namespace, tiny_model, 24), worker(spawn, namespace, tiny_model, 256)
    first = start_frontend(spawn, namespace, mode="direct")
    await serving(first, [w1, w2])

    rng = random.Random(18)

    def prefix() -> list[int]:
        return [rng.randrange(10, 500) for _ in range(PREFIX_BLOCKS * BLOCK + 3)]

    on_w1 = [prefix() for _ in range(5)]
    on_w2 = [prefix() for _ in range(3)]
    for tokens in on_w1:
        await asyncio.to_thread(complete_header, first.address, tokens, w1.instance_id)
    for tokens in on_w2:
        await asyncio.to_thread(complete_header, first.address, tokens, w2.instance_id)
    evicted, kept = on_w1[0], on_w1[2:]

    # A kv-mode frontend started now routes each kept prefix to the worker that holds it.
    front = start_frontend(spawn, namespace)
    await serving(front, [w1, w2])

    async def indexed() -> bool:  # within seconds of start, without any new request
        blocks = await index_blocks(front.address)
        return (blocks.get(f"{w1.instance_id:x}", 0) >= len(kept) * PREFIX_BLOCKS
                and blocks.get(f"{w2.instance_id:x}", 0) >= len(on_w2) * PREFIX_BLOCKS)

    await eventually(indexed, 5, "the workers' cached prefixes in the new frontend's index")
    for tokens, target in [*((t, w1) for t in kept), *((t, w2) for t in on_w2)]:
        got = await asyncio.to_thread(complete_header, front.address, [*tokens[:-3], 7, 8])
        assert got == f"{target.instance_id:x}/0"

    # So does python -m router; the evicted prefix matches nowhere.
    spawn("-m", "router", "--namespace", namespace, "--host", "127.0.0.1")
    client = await make_runtime().endpoint(f"{namespace}.router.best_worker").client()
    await client.wait_for_instances(timeout=15)

    async def best(tokens: list[int]) -> dict:
        stream = await client.generate({"model": "tiny", "token_ids": tokens})
        answers = [r.data() async for r in stream]
        assert len(answers) == 1
        return answers[0]

    async def knows_both() -> bool:  # python -m router may discover one worker first
        try:
            answers = [await best(on_w2[0]), await best(kept[-1])]
        except Exception:  # the model is not followed yet
            return False
        return all(a["overlap_blocks"] == PREFIX_BLOCKS for a in answers)

    await eventually(knows_both, 20, "python -m router following both workers")
    for tokens, target in [*((t, w1) for t in kept), *((t, w2) for t in on_w2)]:
        answer = await best(tokens)
        assert answer["worker_id"] == target.instance_id
        assert answer["overlap_blocks"] == PREFIX_BLOCKS
    assert (await best(evicted))["matches"] == {}


async def test_the_dump_carries_the_workers_own_hashes(namespace, spawn, tiny_model):
    # A dump from a worker that hashes at the edge is indexed from its hashes (the edge path),
    # tokens unread, like its live events; and it still routes the prefix to it.
    w = worker(spawn, namespace, tiny_model, 256)
    first = start_frontend(spawn, namespace, mode="direct")
    await serving(first, [w])
    rng = random.Random(25)
    tokens = [rng.randrange(10, 500) for _ in range(PREFIX_BLOCKS * BLOCK + 3)]
    await asyncio.to_thread(complete_header, first.address, tokens, w.instance_id)

    front = start_frontend(spawn, namespace)
    await serving(front, [w])

    async def edge_indexed() -> float:
        status, page = await asyncio.to_thread(get, f"{front.address}/metrics")
        assert status == 200
        for family in text_string_to_metric_families(page.decode()):
            for s in family.samples:
                if (s.name == "dynamo_router_edge_hashed_blocks_total"
                        and s.labels.get("model") == "tiny" and s.value >= PREFIX_BLOCKS):
                    return s.value
        return 0.0

    # Only the dump brings blocks (no request went through this frontend yet).
    await eventually(edge_indexed, 10, "the dump's blocks indexed from their own hashes")

    async def indexed() -> bool:
        return (await index_blocks(front.address)).get(f"{w.instance_id:x}", 0) >= PREFIX_BLOCKS

    await eventually(indexed, 10, "the dump's blocks in the index gauge")
