"""Busy workers in kv mode, all real processes: a frontend with a busy threshold and a small wait
queue, two slow mocker workers with small KV caches. A busy worker gets no new request while the
other can take it; when both are busy, requests wait (and complete once one frees) and beyond the
queue's bound get 503 with ``Retry-After`` in OpenAI's error shape. Plus the busy logic and the
wait queue on their own (real objects)."""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import random
import subprocess
import sys
from typing import Any

import pytest

from dynamo_zmq import errors
from router.busy import AdmissionQueue, BusyPolicy, PrefillTokens
from router.metrics import RouterMetrics
from router.options import add_kv_router_args, kv_router_options
from router.scheduler import LoadTracker
from tests.support.completions import complete_worker_tokens
from tests.support.metrics import first_sample, metrics_page
from tests.support.mocker_fleet import mocker_fleet
from tests.support.waiting import eventually

BLOCK = 16
TOTAL_BLOCKS = 32  # each worker's KV cache
LONG_PROMPT_BLOCKS = 20  # a long request alone holds more than half of it: busy at 0.5
LONG_OUTPUT = 150  # prompt + output fit in the cache: 30 blocks
QUEUE = 2


@pytest.fixture
async def busy_cluster(namespace, spawn, tiny_model):
    # Overlap weight 2: without the busy rule, a request sharing a running request's long prefix
    # would join it on its (full) worker.
    fleet = await mocker_fleet(
        spawn, namespace, tiny_model, 2, speedup="0.25",
        worker_args=("--block-size", str(BLOCK), "--num-gpu-blocks-override", str(TOTAL_BLOCKS)),
        frontend_args=("--kv-overlap-score-weight", "2", "--busy-kv-threshold", "0.5",
                       "--busy-queue-size", str(QUEUE), "--busy-queue-timeout", "90"))
    url, ids = fleet.url, fleet.ids

    async def reported() -> bool:  # both reported their cache size
        text = await metrics_page(url)
        return all(first_sample(text, "dynamo_router_reported_active_blocks", worker=i) is not None
                   for i in ids)

    await eventually(reported, 30, "both workers serving and reporting load")
    return url, ids


def raw_completion(url: str, prompt: list[int]) -> tuple[int, str | None, dict[str, Any]]:
    """A completion over raw HTTP: (status, Retry-After header, JSON body)."""
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
    try:
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.getheader("retry-after"), json.loads(resp.read())
    finally:
        conn.close()


async def test_busy_workers_are_skipped_then_requests_wait_then_503(busy_cluster) -> None:
    url, ids = busy_cluster
    rng = random.Random(18)

    def prompt(blocks: int) -> list[int]:
        return [rng.randrange(10, 500) for _ in range(blocks * BLOCK)]

    async def indexed_on(blocks: int, exclude: str = "") -> str | None:
        text = await metrics_page(url)
        for i in ids - {exclude}:
            n = first_sample(text, "dynamo_router_kv_index_blocks", model="tiny", worker=i)
            if n is not None and n >= blocks:
                return i
        return None

    # A long request makes its worker (x) busy: its prompt alone is over half of the cache.
    shared = prompt(LONG_PROMPT_BLOCKS)
    first = asyncio.create_task(asyncio.to_thread(complete_worker_tokens, url, shared, LONG_OUTPUT))
    x = await eventually(lambda: indexed_on(LONG_PROMPT_BLOCKS), 30, "the long prompt indexed")

    # 1. A request sharing that prefix would be cheapest on x (overlap weight 2), but x is
    # busy and the other worker is not: it goes there.
    got, _ = await asyncio.to_thread(complete_worker_tokens, url, [*shared, 1, 2, 3], 2)
    assert got != x and got in ids

    # 2. Another long request makes the other worker (y) busy too.
    second = asyncio.create_task(asyncio.to_thread(complete_worker_tokens, url,
                                                   prompt(LONG_PROMPT_BLOCKS), LONG_OUTPUT))

    async def routed() -> bool:  # the first three requests routed, the third to y
        text = await metrics_page(url)
        return first_sample(text, "dynamo_router_decisions_total", model="tiny") == 3

    await eventually(routed, 30, "the second long request routed")

    # 3. Every worker busy: the next requests wait in the frontend (sent nowhere yet) ...
    waiting = [asyncio.create_task(asyncio.to_thread(complete_worker_tokens, url, prompt(2), 2))
               for _ in range(QUEUE)]

    async def queued() -> bool:
        text = await metrics_page(url)
        return first_sample(text, "dynamo_router_busy_queued_requests", model="tiny") == QUEUE

    await eventually(queued, 30, f"{QUEUE} requests queued")

    # 4. ... and beyond the queue's bound one is refused: 503, Retry-After, OpenAI's shape.
    status, retry_after, body = await asyncio.to_thread(raw_completion, url, prompt(2))
    assert status == 503, body
    assert retry_after is not None and int(retry_after) >= 1
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "service_unavailable_error" and err["code"] == "overloaded"

    # 5. Capacity frees as the long requests finish: the waiting ones complete.
    for done in await asyncio.wait_for(asyncio.gather(first, second, *waiting), 100):
        assert done[0] in ids
    assert [n for _, n in [first.result(), second.result()]] == [LONG_OUTPUT] * 2
    assert second.result()[0] != x  # the second long request went to the free worker
    text = await metrics_page(url)
    assert first_sample(text, "dynamo_router_busy_queued_requests", model="tiny") == 0
    assert first_sample(text, "dynamo_router_busy_rejected_total", model="tiny") == 1
    waited = first_sample(text, "dynamo_router_busy_wait_seconds_count", model="tiny")
    assert waited is not None and waited >= QUEUE


async def test_unprefilled_prompt_tokens_make_a_worker_busy(namespace, spawn, tiny_model):
    """``--busy-prefill-tokens``: a worker still prefilling a long prompt takes nothing new (the
    KV bound off); with both workers prefilling, the next request waits, and the one after is
    refused."""
    fleet = await mocker_fleet(
        spawn, namespace, tiny_model, 2, speedup="0.005", worker_args=("--block-size", str(BLOCK)),
        frontend_args=("--busy-kv-threshold", "0", "--busy-prefill-tokens", "500",
                       "--busy-queue-size", "1", "--busy-queue-timeout", "60"))
    url, ids = fleet.url, fleet.ids
    rng = random.Random(7)

    def prompt(tokens: int) -> list[int]:
        return [rng.randrange(10, 500) for _ in range(tokens)]

    # Two long prompts (seconds of prefill each at this speed) take one worker each.
    longs = [asyncio.create_task(asyncio.to_thread(complete_worker_tokens, url, prompt(1000), 1))
             for _ in range(2)]

    async def routed() -> bool:
        text = await metrics_page(url)
        return first_sample(text, "dynamo_router_decisions_total", model="tiny") == 2

    await eventually(routed, 30, "both long prompts routed")
    short = asyncio.create_task(asyncio.to_thread(complete_worker_tokens, url, prompt(BLOCK), 1))

    async def queued() -> bool:
        text = await metrics_page(url)
        return first_sample(text, "dynamo_router_busy_queued_requests", model="tiny") == 1

    await eventually(queued, 30, "the short request queued")
    status, retry_after, body = await asyncio.to_thread(raw_completion, url, prompt(BLOCK))
    assert status == 503 and retry_after is not None, body
    served = await asyncio.wait_for(asyncio.gather(*longs, short), 100)
    assert {w for w, _ in served[:2]} == ids  # one long prompt per worker, never both on one
    assert served[2][0] in ids


@pytest.mark.parametrize("main", ["router", "dynamo_zmq.frontend"])
@pytest.mark.parametrize(("flags", "message"), [
    (["--busy-kv-threshold", "nan"], "--busy-kv-threshold must be a finite number"),
    (["--busy-kv-threshold", "-0.5"], "--busy-kv-threshold must be a finite number"),
    (["--busy-prefill-tokens", "-1"], "--busy-prefill-tokens must be >= 0"),
    (["--busy-queue-size", "-1"], "--busy-queue-size must be >= 0"),
    (["--busy-queue-timeout", "0"], "--busy-queue-timeout must be a finite number > 0"),
])
def test_busy_flags_that_cannot_work_are_refused(main, flags, message):
    mode = ["--router-mode", "kv"] if main == "dynamo_zmq.frontend" else []
    res = subprocess.run([sys.executable, "-m", main, *mode, *flags],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and message in res.stderr


def test_busy_flags_have_env_equivalents(monkeypatch):
    for var, value in (("DYN_BUSY_KV_THRESHOLD", "0.8"), ("DYN_BUSY_PREFILL_TOKENS", "4096"),
                       ("DYN_BUSY_QUEUE_SIZE", "7"), ("DYN_BUSY_QUEUE_TIMEOUT", "2.5")):
        monkeypatch.setenv(var, value)
    parser = argparse.ArgumentParser()
    add_kv_router_args(parser)
    got = kv_router_options(parser.parse_args([]))
    assert (got["busy_kv_threshold"], got["busy_prefill_tokens"], got["busy_queue_size"],
            got["busy_queue_timeout"]) == (0.8, 4096, 7, 2.5)


# -- the busy rule and the wait queue on their own (real objects) ------------------------------


async def until(condition: Any, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not within {timeout}s")


def test_a_rank_is_busy_above_its_kv_fraction_or_its_unprefilled_tokens() -> None:
    loads, prefill = LoadTracker(), PrefillTokens()
    policy = BusyPolicy(kv_threshold=0.5, prefill_tokens=100)
    a = (1, 0)
    assert not policy.is_busy(a, loads, prefill)  # nothing known
    loads.report(a, 40, total_blocks=100)
    assert not policy.is_busy(a, loads, prefill)
    loads.add(a, range(11))  # routed since the report: 51 of 100
    assert policy.is_busy(a, loads, prefill)
    assert not policy.is_busy(a, LoadTracker(), prefill)  # total unknown: never busy by KV
    b = (2, 0)
    prefill.add(b, 101)
    assert policy.is_busy(b, loads, prefill)
    prefill.done(b, 101)
    assert not policy.is_busy(b, loads, prefill)
    off = BusyPolicy()
    assert not off.enabled and not off.is_busy(a, loads, prefill)


async def test_the_wait_queue_is_first_in_first_out_and_bounded_in_count_and_time() -> None:
    metrics = RouterMetrics()
    queue = AdmissionQueue(max_size=2, max_wait=30, metrics=metrics, model="m")
    capacity = 0
    order: list[int] = []

    def free() -> bool:
        return capacity > 0

    async def request(i: int) -> None:
        nonlocal capacity
        await queue.admit(free, None)
        capacity -= 1  # routed: takes the slot (no await between, as KvRouter does)
        order.append(i)

    tasks = [asyncio.create_task(request(i)) for i in range(2)]
    await until(lambda: len(queue) == 2)
    with pytest.raises(errors.Overloaded):  # full
        await queue.admit(free, None)
    capacity = 1
    queue.notify()
    await until(lambda: bool(order))
    assert order == [0] and len(queue) == 1  # the first in went; the second still waits
    capacity = 1
    queue.notify()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert order == [0, 1]

    short = AdmissionQueue(max_size=5, max_wait=0.2, metrics=metrics, model="t")
    with pytest.raises(errors.Overloaded) as exc:
        await asyncio.wait_for(short.admit(lambda: False, None), 10)
    assert exc.value.retry_after == 0.2 and len(short) == 0
