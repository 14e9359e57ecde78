"""``--kv-prefill-load-weight``: a worker's queued prefill (uncached prompt tokens routed to it
and not yet prefilled) counts in its load, so a request sharing a prefix with a worker that is
busy prefilling a long prompt goes to the idle one instead; with weight 0 (Dynamo's cost) it
joins the busy worker for its cached prefix. All real processes: two slow mocker workers and a
kv-mode frontend, requests through the real openai client."""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys

import pytest

from router.options import add_kv_router_args, kv_router_options
from tests.support.completions import complete_worker_tokens
from tests.support.metrics import first_sample, metrics_page
from tests.support.mocker_fleet import mocker_fleet
from tests.support.waiting import eventually

BLOCK = 16


@pytest.mark.parametrize("weight", [0.0, 10.0])
async def test_queued_prefill_steers_a_shared_prefix_away(namespace, spawn, tiny_model, weight):
    # Dynamo's prefill fit at speedup 0.01: 1,000 uncached tokens take about 3 s.
    url = (await mocker_fleet(
        spawn, namespace, tiny_model, 2, speedup="0.01", worker_args=("--block-size", str(BLOCK)),
        frontend_args=("--kv-overlap-score-weight", "8", "--kv-prefill-load-weight", str(weight)))
    ).url
    rng = random.Random(11)
    prefix = [rng.randrange(10, 500) for _ in range(62 * BLOCK)]

    def tail(n: int) -> list[int]:
        return [rng.randrange(10, 500) for _ in range(n)]

    first, _ = await asyncio.to_thread(complete_worker_tokens, url, prefix, 1)  # cached on `first`

    async def indexed() -> bool:  # the router saw its blocks stored
        text = await metrics_page(url)
        return (first_sample(text, "dynamo_router_kv_index_size_blocks") or 0) >= 62

    await eventually(indexed, 30, "the prefix indexed")
    # A long prompt on the same prefix joins it there, with 1,000 tokens to prefill.
    long = asyncio.create_task(asyncio.to_thread(complete_worker_tokens, url, prefix + tail(1000),
                                                 1))

    async def routed() -> bool:
        text = await metrics_page(url)
        return first_sample(text, "dynamo_router_decisions_total", model="tiny") == 2

    await eventually(routed, 30, "the long prompt routed")
    probe, _ = await asyncio.to_thread(complete_worker_tokens, url, prefix + tail(BLOCK), 1)
    long_worker, _ = await asyncio.wait_for(long, 60)
    assert long_worker == first
    if weight > 0:
        assert probe != first  # its queued prefill outweighs the 62 cached blocks
    else:
        assert probe == first  # Dynamo's cost: the cached prefix wins over the active blocks


def test_the_flag_has_an_env_equivalent_and_refuses_nonsense(monkeypatch):
    monkeypatch.setenv("DYN_KV_PREFILL_LOAD_WEIGHT", "2.5")
    parser = argparse.ArgumentParser()
    add_kv_router_args(parser)
    assert kv_router_options(parser.parse_args([]))["prefill_load_weight"] == 2.5
    res = subprocess.run([sys.executable, "-m", "router", "--kv-prefill-load-weight", "-1"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--kv-prefill-load-weight" in res.stderr
