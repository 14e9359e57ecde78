"""Prefix matches of requests in flight (``router/_inflight.py``): in kv mode a request sharing
its prefix with one still queued or prefilling (whose blocks no KV event has announced yet) joins
it on its worker, as the approximate mode would; with ``--no-kv-inflight-overlap`` the index
knows nothing yet and the load sends it to the other worker, where the prefix is computed again.
All real processes: two slow mocker workers and a kv-mode frontend, the real openai client."""

from __future__ import annotations

import argparse
import asyncio
import random

import pytest

from router._inflight import with_inflight
from router.hashing import block_hashes
from router.options import add_kv_router_args, kv_router_options
from router.scheduler import LoadTracker
from tests.support.completions import complete_worker_tokens
from tests.support.metrics import first_sample, metrics_page
from tests.support.mocker_fleet import mocker_fleet
from tests.support.waiting import eventually

BLOCK = 16


@pytest.mark.parametrize("inflight", [True, False])
async def test_a_prefix_in_flight_counts_as_matched(namespace, spawn, tiny_model, inflight):
    # Dynamo's prefill fit at speedup 0.01: 1,000 uncached tokens take about 3 s.
    flags = [] if inflight else ["--no-kv-inflight-overlap"]
    url = (await mocker_fleet(
        spawn, namespace, tiny_model, 2, speedup="0.01", worker_args=("--block-size", str(BLOCK)),
        frontend_args=("--kv-overlap-score-weight", "8", *flags))).url
    rng = random.Random(7)
    prefix = [rng.randrange(10, 500) for _ in range(62 * BLOCK)]
    first = asyncio.create_task(asyncio.to_thread(complete_worker_tokens, url, prefix, 1))

    async def routed() -> bool:
        text = await metrics_page(url)
        return first_sample(text, "dynamo_router_decisions_total", model="tiny") == 1

    await eventually(routed, 30, "the first prompt routed")
    text = await metrics_page(url)
    assert not first_sample(text, "dynamo_router_kv_index_size_blocks")  # still prefilling
    tail = [rng.randrange(10, 500) for _ in range(BLOCK)]
    second, _ = await asyncio.to_thread(complete_worker_tokens, url, prefix + tail, 1)
    first_worker, _ = await asyncio.wait_for(first, 60)
    text = await metrics_page(url)
    matched = first_sample(text, "dynamo_router_matched_blocks_total", model="tiny")
    if inflight:
        assert second == first_worker  # 62 blocks in flight there outweigh its load
        assert matched == 62
    else:
        assert second != first_worker  # nothing indexed yet: the idle worker wins
        assert not matched


def test_inflight_matches_extend_the_index_along_active_prompts():
    loads = LoadTracker()
    a = block_hashes(list(range(64)), BLOCK)  # 4 blocks
    b = block_hashes(list(range(32)) + [999] * 32, BLOCK)  # shares 2 blocks with a
    loads.add((1, 0), a)
    route = loads.add((2, 0), b[:3])
    got = with_inflight({(2, 0): 1, (3, 0): 2}, a, [(1, 0), (2, 0), (3, 0)], loads)
    assert got == {(1, 0): 4, (2, 0): 2, (3, 0): 2}
    loads.release(route)  # finished: only the index speaks for (2, 0)
    assert with_inflight({(2, 0): 1}, a, [(2, 0)], loads) == {(2, 0): 1}


def test_the_flag_has_an_env_equivalent(monkeypatch):
    parser = argparse.ArgumentParser()
    add_kv_router_args(parser)
    assert kv_router_options(parser.parse_args([]))["inflight_overlap"] is True
    assert kv_router_options(parser.parse_args(["--no-kv-inflight-overlap"]))[
        "inflight_overlap"] is False
    monkeypatch.setenv("DYN_KV_INFLIGHT_OVERLAP", "0")
    parser = argparse.ArgumentParser()
    add_kv_router_args(parser)
    assert kv_router_options(parser.parse_args([]))["inflight_overlap"] is False
