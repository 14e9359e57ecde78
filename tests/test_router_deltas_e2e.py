"""Own-hash deltas through real processes: mocker workers that publish ``OwnBatch`` payloads and
advertise ``kv_hash_scheme.form = "deltas"`` (the mocker's default ``--kv-event-form``), a kv-mode
frontend that indexes them (``decode_own_batch``, no token ids) and routes each prefix to its
worker, and a second frontend started later that gets the same state from the workers' dumps
(in delta form) and routes the same way before any request went through it."""

from __future__ import annotations

import asyncio
import random

from prometheus_client.parser import text_string_to_metric_families

from tests.support.completions import complete_header
from tests.support.http_calls import get
from tests.support.mocker_fleet import mocker_fleet, serving, start_frontend
from tests.support.waiting import eventually

BLOCK = 16
PREFIX_BLOCKS = 6


async def samples(url: str, name: str) -> dict[str, float]:
    """Samples of metric ``name`` for model 'tiny', summed per worker label ('' when none)."""
    status, page = await asyncio.to_thread(get, f"{url}/metrics")
    assert status == 200
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(page.decode()):
        for s in family.samples:
            if s.name == name and s.labels.get("model") == "tiny":
                w = s.labels.get("worker", "")
                out[w] = out.get(w, 0) + s.value
    return out


async def test_kv_frontends_route_by_prefix_from_delta_events_and_dumps(
    namespace, spawn, tiny_model
):
    fleet = await mocker_fleet(spawn, namespace, tiny_model, 2, worker_args=(
        "--block-size", str(BLOCK), "--num-gpu-blocks-override", "256",
        "--kv-replay-buffer-size", "2", "--kv-event-form", "deltas"))
    front, ids = fleet.front, fleet.ids

    rng = random.Random(26)
    prefixes = [[rng.randrange(10, 500) for _ in range(PREFIX_BLOCKS * BLOCK + 3)]
                for _ in range(6)]
    # Each prefix's first request lands somewhere; every later one with that prefix (and
    # another tail) must follow it, which only the index of the delta events can tell.
    placed = {}
    for i, tokens in enumerate(prefixes):
        placed[i] = await asyncio.to_thread(complete_header, front.address, tokens)

    async def indexed(url: str) -> bool:
        blocks = await samples(url, "dynamo_router_kv_index_blocks")
        return sum(blocks.get(w, 0) for w in ids) >= len(prefixes) * PREFIX_BLOCKS

    await eventually(lambda: indexed(front.address), 10, "the delta events indexed")
    for i, tokens in enumerate(prefixes):
        got = await asyncio.to_thread(complete_header, front.address, [*tokens[:-3], 7, 8, 9])
        assert got == placed[i], (i, got, placed[i])
    edge = await samples(front.address, "dynamo_router_edge_hashed_blocks_total")
    assert edge.get("", 0) >= len(prefixes) * PREFIX_BLOCKS
    errors = await samples(front.address, "dynamo_router_kv_event_decode_errors_total")
    assert sum(errors.values()) == 0

    # A frontend started now gets each worker's state in one dump (the workers keep only 2
    # batches for replay) and routes every prefix to its worker without a request of its own.
    late = start_frontend(spawn, namespace)
    await serving(late, fleet.workers)
    await eventually(lambda: indexed(late.address), 10, "the dumps indexed")
    for i, tokens in enumerate(prefixes):
        got = await asyncio.to_thread(complete_header, late.address, [*tokens[:-3], 5, 6])
        assert got == placed[i], (i, got, placed[i])
