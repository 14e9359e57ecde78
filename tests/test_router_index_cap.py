"""The KV index's cap end to end, all real processes: a kv-mode frontend started with a small
``--kv-index-max-blocks`` and two mocker workers. Past the cap the index evicts its oldest blocks
(the metric counts them, the index stays within the cap) and the frontend keeps routing by
prefix; ``DYN_KV_INDEX_MAX_BLOCKS`` sets the same cap. Both index layouts (``--kv-index-layout
dicts|packed``) run the same test."""

from __future__ import annotations

import asyncio
import random
import re

import pytest

from router import __main__ as router_main
from router.options import kv_router_options
from tests.support.completions import complete_header_body
from tests.support.metrics import metrics_page
from tests.support.mocker_fleet import mocker_fleet
from tests.support.waiting import eventually

BLOCK = 16
CAP = 48
PREFIX_BLOCKS = 6


def sample(metrics: str, name: str) -> float:
    """The value of ``name{model="tiny"}`` on a /metrics page (0 when absent)."""
    m = re.search(rf'^{name}\{{model="tiny"\}} (\S+)$', metrics, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(params=["dicts", "packed"])
async def capped(request, namespace, spawn, tiny_model):
    fleet = await mocker_fleet(
        spawn, namespace, tiny_model, 2,
        # The stores form: its parent links let the cap evict leaves first, which keeps a hot
        # prefix's head (delta keys evict strictly oldest first: docs/operations.md).
        worker_args=("--block-size", str(BLOCK), "--num-gpu-blocks-override", "512",
                     "--kv-event-form", "stores"),
        frontend_args=("--kv-index-max-blocks", str(CAP), "--kv-index-layout", request.param))
    front, url = fleet.front, fleet.url

    async def both_serving() -> bool:
        page = await metrics_page(url)
        return len(re.findall(r'^dynamo_router_kv_index_blocks\{[^}]*model="tiny"', page,
                              re.MULTILINE)) == 2

    await eventually(both_serving, 30, "both workers followed by the frontend's router")
    # The packed layout says so when the index is made (the dicts layout, the default, does not).
    assert ("KV index in the packed layout" in front.logs()) == (request.param == "packed")
    return url


async def test_capped_index_evicts_and_keeps_routing_by_prefix(capped):
    url = capped
    rng = random.Random(18)

    def prompt(blocks: int) -> list[int]:
        return [rng.randrange(10, 500) for _ in range(blocks * BLOCK)]

    # 1. Unrelated prompts, about twice the cap in blocks: the index evicts, stays within the cap.
    for _ in range(2 * CAP // PREFIX_BLOCKS):
        await asyncio.to_thread(complete_header_body, url, [*prompt(PREFIX_BLOCKS), 1, 2])

    async def evicted() -> float:
        return sample(await metrics_page(url), "dynamo_router_kv_index_evicted_blocks_total")

    await eventually(evicted, 15, "evictions counted in the metric")
    page = await metrics_page(url)
    assert 0 < sample(page, "dynamo_router_kv_index_size_blocks") <= CAP

    # 2. A new prefix, once indexed (a request is credited with its blocks), keeps its worker.
    prefix = prompt(PREFIX_BLOCKS)
    target, _ = await asyncio.to_thread(complete_header_body, url, [*prefix, 7])

    async def credited() -> bool:
        before = sample(await metrics_page(url), "dynamo_router_matched_blocks_total")
        got, _ = await asyncio.to_thread(complete_header_body, url, [*prefix, *prompt(1)])
        after = sample(await metrics_page(url), "dynamo_router_matched_blocks_total")
        return got == target and after - before >= PREFIX_BLOCKS

    await eventually(credited, 15, "the new prefix credited to the worker that served it")
    for i in range(6):
        got, _ = await asyncio.to_thread(complete_header_body, url, [*prefix, *prompt(1 + i % 3)])
        assert got == target, f"request {i} with the shared prefix went to {got}, not {target}"

    # 3. A little more unrelated load (older blocks than the prefix's are left to evict): still
    # evicting, still within the cap, the prefix still routed.
    before = await evicted()
    for _ in range(2):
        await asyncio.to_thread(complete_header_body, url, [*prompt(PREFIX_BLOCKS), 3])
    got, _ = await asyncio.to_thread(complete_header_body, url, [*prefix, *prompt(2)])
    assert got == target
    await eventually(lambda: _more(evicted, before), 15, "more evictions counted")
    assert sample(await metrics_page(url), "dynamo_router_kv_index_size_blocks") <= CAP


async def _more(evicted, before: float) -> bool:
    return await evicted() > before


def test_cap_flag_and_env(monkeypatch):
    assert kv_router_options(router_main.build_parser().parse_args([]))["index_max_blocks"] is None
    args = router_main.build_parser().parse_args(["--kv-index-max-blocks", "1000"])
    assert kv_router_options(args)["index_max_blocks"] == 1000
    monkeypatch.setenv("DYN_KV_INDEX_MAX_BLOCKS", "500")
    assert kv_router_options(router_main.build_parser().parse_args([]))["index_max_blocks"] == 500


def test_layout_flag_and_env(monkeypatch):
    parse = router_main.build_parser().parse_args
    assert kv_router_options(parse([]))["index_layout"] == "packed"
    assert kv_router_options(parse(["--kv-index-layout", "dicts"]))["index_layout"] == "dicts"
    monkeypatch.setenv("DYN_KV_INDEX_LAYOUT", "dicts")  # read when the parser is built
    assert kv_router_options(router_main.build_parser().parse_args([]))["index_layout"] == "dicts"
    with pytest.raises(SystemExit):
        parse(["--kv-index-layout", "trie"])
