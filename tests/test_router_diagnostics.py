"""The KV router's self-diagnosis through real processes: a kv-mode frontend over mocker workers
that publish no KV events, publish none despite an endpoint (prefix caching off), or use
another block size says so in its log (one line per worker or period) and in its metrics."""

from __future__ import annotations

import asyncio
import random

from router.diagnostics import FLAT_STREAK, SILENT_AFTER
from tests.support.completions import complete_worker
from tests.support.metrics import fetch_sample
from tests.support.mocker_fleet import serving, start_frontend, start_mocker
from tests.support.procs import Proc
from tests.support.waiting import eventually

BLOCK = 16


def worker(spawn, namespace, model_dir, *extra: str, block: int = BLOCK) -> Proc:
    return start_mocker(spawn, namespace, model_dir, "--block-size", str(block), *extra)


def prompt(rng: random.Random, blocks: int = 2) -> list[int]:
    return [rng.randrange(10, 500) for _ in range(blocks * BLOCK + 3)]


async def test_workers_without_kv_events_are_silent_and_scores_flat(namespace, spawn, tiny_model):
    workers = [worker(spawn, namespace, tiny_model, "--no-kv-events") for _ in range(2)]
    front = start_frontend(spawn, namespace)
    url = await serving(front, workers)

    async def both_silent() -> bool:
        return await fetch_sample(url, "dynamo_router_silent_workers") == 2

    await eventually(both_silent, 10, "dynamo_router_silent_workers at 2")
    logs = front.logs()
    for w in workers:
        assert f"instance {w.instance_id:x} of model 'tiny' advertises no KV-event endpoint" in logs

    rng = random.Random(7)
    for _ in range(FLAT_STREAK):  # every decision has nothing to tell the workers apart
        await asyncio.to_thread(complete_worker, url, prompt(rng))
    assert await fetch_sample(url, "dynamo_router_flat_decisions_total") >= FLAT_STREAK
    logs = front.logs()
    assert "routing was on load alone: the index is empty: 2 worker(s) publish no KV" in logs
    assert logs.count("routing was on load alone") == 1  # once per period


async def test_a_worker_that_never_publishes_turns_silent(namespace, spawn, tiny_model):
    """Prefix caching off: the worker advertises KV events but never sends one."""
    talker = worker(spawn, namespace, tiny_model)
    mute = worker(spawn, namespace, tiny_model, "--no-enable-prefix-caching")
    front = start_frontend(spawn, namespace)
    url = await serving(front, [talker, mute])
    rng = random.Random(8)
    for _ in range(10):  # until the mute worker has been sent a request (ties are random)
        got = await asyncio.gather(*(asyncio.to_thread(complete_worker, url, prompt(rng), 16)
                                     for _ in range(4)))
        if f"{mute.instance_id:x}" in got:
            break
    else:
        raise AssertionError("no request routed to the mute worker")
    # Not yet: it may just be slow.
    assert await fetch_sample(url, "dynamo_router_silent_workers") == 0

    async def silent() -> bool:
        return await fetch_sample(url, "dynamo_router_silent_workers") == 1

    await eventually(silent, SILENT_AFTER + 10, "the mute worker counted as silent")
    logs = front.logs()
    assert f"instance {mute.instance_id:x} of model 'tiny' has published no KV event" in logs
    assert f"instance {talker.instance_id:x} of model 'tiny' has published" not in logs


async def test_a_block_size_mismatch_is_reported(namespace, spawn, tiny_model):
    first = worker(spawn, namespace, tiny_model)
    front = start_frontend(spawn, namespace)
    url = await serving(front, [first])
    # (The stores form: its events carry their block size, which the router checks.)
    other = worker(spawn, namespace, tiny_model, "--kv-event-form", "stores",
                   block=2 * BLOCK).wait_ready()
    await serving(front, [first, other])

    async def mismatched() -> bool:
        return await fetch_sample(url, "dynamo_router_mismatched_workers", reason="block_size") == 1

    await eventually(mismatched, 10, "dynamo_router_mismatched_workers at 1")
    assert (f"instance {other.instance_id:x} uses KV block size {2 * BLOCK} but the router "
            f"indexes with {BLOCK}") in front.logs()

    rng = random.Random(9)
    for _ in range(10):  # until the other worker has stored blocks of its size
        got = await asyncio.gather(*(asyncio.to_thread(complete_worker, url, prompt(rng, 4), 16)
                                     for _ in range(4)))
        if f"{other.instance_id:x}" in got:
            break
    else:
        raise AssertionError("no request routed to the mismatched worker")

    async def ignored() -> bool:
        return await fetch_sample(url, "dynamo_router_kv_block_size_mismatches_total") > 0

    await eventually(ignored, 10, "the mismatched worker's KV events counted as ignored")
    assert "ignored: their block size is not the router's 16" in front.logs()


async def test_a_hash_scheme_mismatch_is_reported(namespace, spawn, tiny_model):
    # The worker hashes its blocks from another root seed: its published hashes are not the
    # router's, so the router says so and hashes the tokens of its events instead.
    # (The stores form: its events carry the tokens the router falls back to.)
    other = worker(spawn, namespace, tiny_model, "--kv-hash-seed", "12345", "--kv-event-form",
                   "stores")
    front = start_frontend(spawn, namespace)
    url = await serving(front, [other])

    async def mismatched() -> bool:
        return await fetch_sample(url, "dynamo_router_mismatched_workers",
                                  reason="hash_scheme") == 1

    await eventually(mismatched, 10, "dynamo_router_mismatched_workers{hash_scheme} at 1")
    assert await fetch_sample(url, "dynamo_router_mismatched_workers", reason="block_size") == 0
    logs = front.logs()
    assert f"instance {other.instance_id:x} of model 'tiny' hashes its KV blocks as" in logs
    assert "seed 12345" in logs

    # Routing by prefix still works: the store was indexed from its tokens, so the same prompt
    # matches all its blocks the second time.
    tokens = prompt(random.Random(11), 4)
    await asyncio.to_thread(complete_worker, url, tokens, 2)
    w = f"{other.instance_id:x}"

    async def indexed() -> bool:
        return await fetch_sample(url, "dynamo_router_kv_index_blocks", worker=w) >= 4

    await eventually(indexed, 10, "the worker's blocks indexed")
    before = await fetch_sample(url, "dynamo_router_matched_blocks_total")
    await asyncio.to_thread(complete_worker, url, tokens, 2)
    assert await fetch_sample(url, "dynamo_router_matched_blocks_total") - before >= 4
    assert await fetch_sample(url, "dynamo_router_edge_hashed_blocks_total") == 0
