"""Read samples from a Prometheus text page (a worker's or a frontend's ``/metrics``)."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from tests.support.http_calls import get


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
