"""A worker comes back into routing soon after a long partition heals (issue 33 item 7).

Three namespace hosts on one bridge: a frontend on A, mocker workers on B and C. B's link is cut
for 30 s (frames dropped, link up: connects hang rather than fail) and then healed. Before the
fix B came back 10-25 s after the heal: the frontend's connection to B sat ESTABLISHED in TCP's
retransmission backoff (its next retry seconds to minutes away), and a connect started during
the cut waited in the kernel's SYN backoff. Every connecting socket now gives up unacknowledged
data after ``TCP_MAXRT_MS`` and a connect after ``CONNECT_TIMEOUT_MS``, and reconnects at most
``RECONNECT_IVL_MAX_MS`` apart: B is routed to again well within ``REJOIN_WITHIN`` (the figure,
about half a second, is measured by ``scripts/bench_rejoin.py``; docs/benchmarks.md).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dynamo_zmq.tools.child_process import ChildProcess
from tests.support.cluster import Cluster, cluster, complete, frontend, mocker_worker, wait_until

#: How long B is cut off.
CUT = 30.0
#: A bound that cannot flake on a loaded 2-core machine, well under the 10-25 s of before.
REJOIN_WITHIN = 5.0


def _routed(cl: Cluster) -> set[int]:
    """The instances A's frontend routes to now (its /health)."""
    resp = cl["a"].http(8000).get("/health")
    if resp.status_code != 200:
        return set()
    return {int(i, 16) for ids in resp.json()["models"].values() for i in ids}


@pytest.fixture(scope="module")
def partitioned(tiny_model: Path) -> Iterator[tuple[Cluster, dict[str, ChildProcess], Any]]:
    with cluster("a", "b", "c") as built:
        workers = {h: mocker_worker(built[h], tiny_model) for h in ("b", "c")}
        frontend(built["a"])
        client = built["a"].openai_client(8000)
        want = {w.instance_id for w in workers.values()}
        assert wait_until(lambda: _routed(built) >= want, 30), _routed(built)
        yield built, workers, client


def test_a_worker_is_routed_again_soon_after_a_30s_partition_heals(
    partitioned: tuple[Cluster, dict[str, ChildProcess], Any],
) -> None:
    cl, workers, client = partitioned
    b, c = workers["b"].instance_id, workers["c"].instance_id
    model = client.models.list().data[0].id
    cl.cut(cl["b"], silent=True)
    t0 = time.monotonic()
    try:
        assert wait_until(lambda: b not in _routed(cl), 10), "B never left routing"
        assert complete(client, model) == c  # served meanwhile, by C
        time.sleep(max(0.0, t0 + CUT - time.monotonic()))
    finally:
        cl.heal(cl["b"])
    healed = time.monotonic()
    assert wait_until(lambda: complete(client, model) == b, REJOIN_WITHIN, step=0.0), (
        f"B not routed to within {REJOIN_WITHIN}s of the heal (routed: {_routed(cl)})"
    )
    print(f"B routed to again {time.monotonic() - healed:.2f}s after a {CUT:.0f}s partition")
    assert workers["b"].running() and workers["c"].running()
