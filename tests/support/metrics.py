"""Read samples from a Prometheus text page (a worker's or a frontend's ``/metrics``)."""

from __future__ import annotations

import asyncio
import re

from prometheus_client.parser import text_string_to_metric_families

from tests.support.http_calls import get


async def metrics_page(url: str) -> str:
    """``url``'s ``/metrics`` page (asserted served: status 200)."""
    status, body = await asyncio.to_thread(get, f"{url}/metrics")
    assert status == 200
    return body.decode()


def sample(page: str, name: str, **labels: str) -> float | None:
    """The value of sample ``name`` whose labels include ``labels``; None if there is none.
    The sum when several match (e.g. a counter over an extra label)."""
    found = [
        s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    return sum(found) if found else None


async def index_blocks(url: str, model: str = "tiny") -> dict[str, float]:
    """The blocks a frontend's KV router indexes per worker (hex id, its ranks summed) for
    ``model``, read from ``url``'s ``/metrics``."""
    status, page = await asyncio.to_thread(get, f"{url}/metrics")
    assert status == 200
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(page.decode()):
        for s in family.samples:
            if s.name == "dynamo_router_kv_index_blocks" and s.labels.get("model") == model:
                out[s.labels["worker"]] = out.get(s.labels["worker"], 0) + s.value
    return out


def first_sample(page: str, name: str, **labels: str) -> float | None:
    """The value of the first sample ``name`` (one with labels) whose labels include
    ``labels``; None if there is none."""
    for m in re.finditer(rf"^{name}\{{(.*)\}} (\S+)$", page, re.MULTILINE):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(2))
    return None


async def fetch_sample(url: str, name: str, *, model: str = "tiny", **labels: str) -> float:
    """The value of the first sample ``name`` of ``model`` whose labels include ``labels``,
    read from ``url``'s ``/metrics``; 0.0 if there is none."""
    for family in text_string_to_metric_families(await metrics_page(url)):
        for s in family.samples:
            if s.name == name and s.labels.get("model") == model and all(
                    s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


def index_blocks_per_rank(page: str, model: str = "tiny") -> dict[str, float]:
    """The blocks a frontend's KV router indexes for ``model`` per ``"<worker>/<rank>"``, from
    a ``/metrics`` page."""
    out: dict[str, float] = {}
    for m in re.finditer(r"^dynamo_router_kv_index_blocks\{(.*)\} (\S+)$", page, re.MULTILINE):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels.get("model") == model:
            out[f"{labels['worker']}/{labels['dp_rank']}"] = float(m.group(2))
    return out
