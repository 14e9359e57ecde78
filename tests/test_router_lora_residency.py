"""The KV router's LoRA residency prediction (router/_lora_residency.py), checked by Hypothesis
against a brute-force model: a rank's resident adapters are the last ``max_loras`` distinct
adapters routed there, and the miss penalty follows from them; plus the cost term in the
router's choice (a resident rank wins while its extra load stays under the penalty)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router._lora_residency import EVICT_FACTOR, LoraResidency, max_loras_of
from router.config import DEFAULT_LORA_MISS_BLOCKS, KvRouterConfig
from router.options import add_kv_router_args, kv_router_options
from router.scheduler import Scheduler

ADAPTERS = (None, "a", "b", "c", "d")
CAPACITY = {1: 1, 2: 2, 3: 3}  # worker id -> max_loras
CANDIDATES = [(w, r) for w in CAPACITY for r in (0, 1)]
routes = st.lists(st.tuples(st.sampled_from(CANDIDATES), st.sampled_from(ADAPTERS)), max_size=40)


def _brute_resident(history: list[tuple[tuple[int, int], str | None]], candidate) -> list[str]:
    """The last ``max_loras`` distinct adapters routed to ``candidate``, oldest first."""
    seen: list[str] = []
    for c, lora in reversed(history):
        if c == candidate and lora is not None and lora not in seen:
            seen.append(lora)
    return list(reversed(seen[: CAPACITY[candidate[0]]]))


@settings(max_examples=200, deadline=None)
@given(routes, st.sampled_from(ADAPTERS), st.sampled_from((0.0, 7.0)))
def test_prediction_is_the_last_max_loras_distinct_adapters(history, ask, miss) -> None:
    res = LoraResidency(miss, CAPACITY.__getitem__)
    for c, lora in history:
        res.routed(c, lora)
    got = res.penalties(CANDIDATES, ask)
    if miss == 0 or ask is None:
        assert got is None
        return
    want = []
    for c in CANDIDATES:
        resident = _brute_resident(history, c)
        assert res.resident(c) == resident
        if ask in resident:
            want.append(0.0)
        else:
            full = len(resident) >= CAPACITY[c[0]]
            want.append(miss * EVICT_FACTOR if full else miss)
    assert got == want


def test_a_removed_worker_is_forgotten_and_a_base_request_is_never_penalised() -> None:
    res = LoraResidency(8.0, lambda _w: 2)
    res.routed((1, 0), "a")
    res.routed((2, 0), None)
    assert res.resident((1, 0)) == ["a"] and res.resident((2, 0)) == []
    assert res.penalties([(1, 0), (2, 0)], "a") == [0.0, 8.0]
    assert res.penalties([(1, 0), (2, 0)], None) is None
    res.remove_worker(1)
    assert res.resident((1, 0)) == []
    with pytest.raises(ValueError):
        LoraResidency(-1.0, lambda _w: 1)


@pytest.mark.parametrize(("extra", "want"), [
    ({"max_loras": 4}, 4), ({}, 1), ({"max_loras": 0}, 1), ({"max_loras": "3"}, 1),
    ({"max_loras": True}, 1), (None, 1),
])
def test_max_loras_from_the_advert(extra, want) -> None:
    assert max_loras_of(extra) == want


def test_the_penalty_is_a_cost_term_load_still_counts() -> None:
    # As KvRouter._decide adds it: to each candidate's load before the scheduler's choice.
    res = LoraResidency(32.0, lambda _w: 1)
    res.routed((1, 0), "a")
    candidates = [(1, 0), (2, 0)]
    sched = Scheduler(1.0)

    def choose(loads: list[float]) -> int:
        misses = res.penalties(candidates, "a") or [0.0, 0.0]
        values = [v + m for v, m in zip(loads, misses, strict=True)]
        return sched.select(candidates, 4, {}, values).worker_id

    assert choose([20.0, 0.0]) == 1  # resident, 20 blocks busier: still cheaper
    assert choose([40.0, 0.0]) == 2  # 40 blocks busier than an idle worker: load wins


def test_the_flag_has_a_default_an_env_equivalent_and_refuses_nonsense(monkeypatch) -> None:
    parser = argparse.ArgumentParser()
    add_kv_router_args(parser)
    opts = kv_router_options(parser.parse_args([]))
    assert opts["lora_miss_blocks"] == DEFAULT_LORA_MISS_BLOCKS == KvRouterConfig().lora_miss_blocks
    monkeypatch.setenv("DYN_KV_LORA_MISS_BLOCKS", "0")
    parser = argparse.ArgumentParser()
    add_kv_router_args(parser)
    assert kv_router_options(parser.parse_args([]))["lora_miss_blocks"] == 0
    res = subprocess.run([sys.executable, "-m", "router", "--kv-lora-miss-blocks", "-1"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--kv-lora-miss-blocks" in res.stderr
