"""Zero configuration across hosts (issue 14 item 2), on the multi-host harness.

Four hosts, each a network namespace on one bridge: frontends on A and D, mocker workers on B
and C, every process started with no discovery flag and no ``DYN_*`` variable. Each test
asserts on what the real ``openai`` client received (``x-dynamo-worker`` names the instance
that served) and leaves the cluster as it found it.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dynamo_zmq.tools.child_process import ChildProcess
from tests.support.cluster import (
    Cluster,
    Host,
    cluster,
    complete,
    frontend,
    mocker_worker,
    wait_until,
)
from tests.support.metrics import sample

#: The issue's bound for a cut or frozen host to leave routing.
LEAVE_WITHIN = 2.0
#: "Used again within a few seconds" of a heal or thaw; also a restarted frontend's bound.
RETURN_WITHIN = 10.0
#: How long after LEAVE_WITHIN the requests keep being checked (all must go to C).
OBSERVE_AFTER = 2.0


@dataclass
class Deployment:
    cluster: Cluster
    workers: dict[str, ChildProcess]
    frontends: dict[str, ChildProcess]
    clients: dict[str, Any] = field(default_factory=dict)
    model: str = ""
    model_dir: Path = Path()
    #: When each frontend printed READY (time.monotonic()).
    started: dict[str, float] = field(default_factory=dict)

    def host(self, name: str) -> Host:
        return self.cluster[name]

    def iid(self, name: str) -> int:
        return self.workers[name].instance_id

    def start_frontend(self, name: str) -> None:
        self.frontends[name] = frontend(self.host(name))
        self.started[name] = time.monotonic()

    def serves_both(self, front: str, timeout: float) -> bool:
        """True once requests through ``front`` have reached both workers."""
        return self.serves_all(front, {self.iid("b"), self.iid("c")}, timeout)

    def serves_all(self, front: str, want: set[int], timeout: float) -> bool:
        """True once requests through ``front`` have reached every instance in ``want``."""
        seen: set[int] = set()

        def step() -> bool:
            seen.add(complete(self.clients[front], self.model))
            return seen >= want

        return wait_until(step, timeout, step=0.0)


@pytest.fixture(scope="module")
def deployment(tiny_model: Path) -> Iterator[Deployment]:
    with cluster("a", "b", "c", "d") as built:
        workers = {h: mocker_worker(built[h], tiny_model) for h in ("b", "c")}
        dep = Deployment(built, workers, {}, model_dir=tiny_model)
        for h in ("a", "d"):
            dep.start_frontend(h)
        dep.clients = {h: built[h].openai_client(8000) for h in dep.frontends}
        models = lambda: [m.id for m in dep.clients["a"].models.list().data]  # noqa: E731
        assert wait_until(lambda: bool(models()), 30), "no model discovered through A"
        dep.model = models()[0]
        yield dep


def test_frontends_on_two_hosts_find_workers_on_two_others(deployment: Deployment) -> None:
    for front in ("a", "d"):
        assert deployment.serves_both(front, 30), (
            f"requests through {front} did not reach both workers"
        )


def test_records_carry_the_hosts_own_address(deployment: Deployment) -> None:
    dep = deployment
    wanted = [f"{dep.iid(h):016x}" for h in ("b", "c")]
    done = dep.host("d").run(
        [sys.executable, "-m", "tests.support.mdns_browse", "15", *wanted], timeout=30
    )
    assert done.returncode == 0, done.stderr
    records = {r["iid"]: r for r in json.loads(done.stdout)}
    for h in ("b", "c"):
        assert records[f"{dep.iid(h):016x}"]["addresses"] == [dep.host(h).address]
    for record in records.values():
        for address in record["addresses"]:
            ip = ipaddress.IPv4Address(address)
            assert not ip.is_loopback and not ip.is_unspecified, record
            assert ip in dep.cluster.subnet, record


def test_kv_events_and_load_reach_a_router_on_another_host(deployment: Deployment) -> None:
    """A KV-routing frontend on A subscribes to each worker's KV-event replay and load sockets
    at the addresses the workers advertised: they must be reachable from A."""
    dep = deployment
    a = dep.host("a")
    kv = frontend(a, "--http-port", "8001", "--router-mode", "kv")
    try:
        client = a.openai_client(8001)
        assert wait_until(lambda: bool(client.models.list().data), 30)
        served = {complete(client, dep.model) for _ in range(4)}
        assert served <= {dep.iid("b"), dep.iid("c")}
        http = a.http(8001)

        def followed() -> bool:
            page = http.get("/metrics").text
            replays = sample(page, "dynamo_router_kv_event_replays_total", result="ok")
            loads = sample(page, "dynamo_router_load_reports_total")
            return replays == 2 and (loads or 0) >= 2

        assert wait_until(followed, 15, step=0.2), http.get("/metrics").text[-3000:]
    finally:
        kv.stop()


def _faults(dep: Deployment) -> dict[str, tuple[Callable[[Host], None], Callable[[Host], None]]]:
    c = dep.cluster
    return {
        "cut": (c.cut, c.heal),
        "silent-cut": (functools.partial(c.cut, silent=True), c.heal),
        "freeze": (c.freeze, c.thaw),
    }


@pytest.mark.parametrize("fault", ["cut", "silent-cut", "freeze"])
def test_a_lost_host_leaves_routing_and_comes_back(deployment: Deployment, fault: str) -> None:
    dep = deployment
    assert dep.serves_both("a", 30)
    client, b, c = dep.clients["a"], dep.iid("b"), dep.iid("c")
    start_fault, end_fault = _faults(dep)[fault]
    start_fault(dep.host("b"))
    try:
        t0 = time.monotonic()
        log: list[tuple[float, int | Exception]] = []
        slowest = 0.0
        while (now := time.monotonic()) < t0 + LEAVE_WITHIN + OBSERVE_AFTER:
            try:
                log.append((now - t0, complete(client, dep.model)))
            except Exception as exc:
                log.append((now - t0, exc))
            slowest = max(slowest, time.monotonic() - now)
        not_c = [(t, got) for t, got in log if got != c]
        late = [(t, got) for t, got in not_c if t >= LEAVE_WITHIN]
        assert not late, f"after {fault} of B, not served by C: {late} (log: {log})"
        assert any(t >= LEAVE_WITHIN for t, _ in log), f"no request after {LEAVE_WITHIN}s: {log}"
        left = max((t for t, _ in not_c), default=0.0)
        print(f"{fault}: B left routing by {left:.2f}s ({len(log)} requests, slowest "
              f"{slowest:.2f}s; not C: {not_c})")
    finally:
        end_fault(dep.host("b"))
    t1 = time.monotonic()
    assert wait_until(lambda: complete(client, dep.model) == b, RETURN_WITHIN, step=0.0), (
        f"B not used again within {RETURN_WITHIN}s of the end of the {fault}"
    )
    print(f"{fault}: B used again {time.monotonic() - t1:.2f}s after the end of the fault")
    assert dep.serves_both("d", RETURN_WITHIN)


def test_a_worker_that_started_while_its_link_was_cut_is_found_after_heal(
    deployment: Deployment,
) -> None:
    """Its announcements were lost, and the frontends ask for new peers only at start (zeroconf
    alone) or every few seconds (our periodic query): it must be found soon after the heal."""
    dep = deployment
    # Past zeroconf's own startup queries (sent up to ~14 s after a frontend starts).
    time.sleep(max(0.0, max(dep.started.values()) + 16.0 - time.monotonic()))
    b = dep.host("b")
    dep.cluster.cut(b)
    try:
        late = mocker_worker(b, dep.model_dir)
        time.sleep(3.0)  # its announcements (0-2 s after READY) go nowhere
    finally:
        dep.cluster.heal(b)
    t0 = time.monotonic()
    try:
        for front in ("a", "d"):
            assert dep.serves_all(front, {late.instance_id}, RETURN_WITHIN), (
                f"{front} did not find the worker started on B while cut, {RETURN_WITHIN}s "
                "after the heal"
            )
        print(f"worker started while cut: found {time.monotonic() - t0:.2f}s after the heal")
    finally:
        late.stop()  # a clean stop: the frontends see its goodbye and stop routing to it
    for front in ("a", "d"):
        assert dep.serves_both(front, RETURN_WITHIN)


def test_a_restarted_frontend_rediscovers_both_workers(deployment: Deployment) -> None:
    dep = deployment
    dep.frontends["a"].stop()
    dep.start_frontend("a")
    t0 = time.monotonic()
    assert dep.serves_both("a", RETURN_WITHIN), (
        f"the restarted frontend did not serve through both workers within {RETURN_WITHIN}s"
    )
    print(f"restarted frontend: both workers served {time.monotonic() - t0:.2f}s after READY")
