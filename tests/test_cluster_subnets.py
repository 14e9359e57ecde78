"""Discovery across routed subnets (issue 31 item 3), on namespace hosts.

Subnet A holds a1 and a2, subnet B holds b1 and b2; a router joins them and forwards unicast,
not multicast (as a plain IP router or an HPC fabric does). The directory every host shares is a
directory of this machine (a shared filesystem, as far as the hosts can tell).

- a2: a mocker worker with mDNS only; b1, b2: mocker workers with ``--discovery mdns,dir``.
- On a1, three frontends: mDNS only (port 8000), the directory only (8001), both (8002).

mDNS alone does not cross the router: the mDNS frontend finds a2's worker and never B's. The
directory does: the directory frontend serves from B's workers, and a B worker SIGKILLed in
the middle of streams loses none of them (the frontend migrates them to the other). The
frontend with both finds a2's worker by mDNS and B's by the directory, and serves from all.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from dynamo_zmq.tools.child_process import ChildProcess
from tests.support.cluster import Cluster, cluster, frontend, mocker_worker, served_by, wait_until

TOKENS = 150
STREAMS = 4
DEADLINE = 40.0
SLOW = ("--speedup-ratio", "0.25")
PORTS = {"mdns": 8000, "dir": 8001, "mdns,dir": 8002}


@dataclass
class Subnets:
    cluster: Cluster
    shared: Path
    workers: dict[str, ChildProcess]
    model: str = ""

    def client(self, discovery: str) -> Any:
        return self.cluster["a1"].openai_client(PORTS[discovery], timeout=DEADLINE + 10)

    def listed(self, discovery: str) -> set[int]:
        """The instances the frontend of ``discovery`` routes to (its /health)."""
        resp = self.cluster["a1"].http(PORTS[discovery]).get("/health")
        if resp.status_code != 200:
            return set()
        return {int(i, 16) for ids in resp.json()["models"].values() for i in ids}

    def ids(self, *hosts: str) -> set[int]:
        return {self.workers[h].instance_id for h in hosts}


@pytest.fixture(scope="module")
def subnets(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Subnets]:
    shared = tmp_path_factory.mktemp("shared") / "dynamo"
    with cluster("a1", "a2", "b1", "b2", subnets={"b1": 1, "b2": 1}) as built:
        both = ("--discovery", "mdns,dir", "--discovery-dir", str(shared))
        dep = Subnets(built, shared, {
            "a2": mocker_worker(built["a2"], tiny_model, *SLOW),
            "b1": mocker_worker(built["b1"], tiny_model, *SLOW, *both),
            "b2": mocker_worker(built["b2"], tiny_model, *SLOW, *both),
        })
        for discovery, port in PORTS.items():
            flags = [] if discovery == "mdns" else ["--discovery", discovery,
                                                    "--discovery-dir", str(shared)]
            frontend(built["a1"], "--http-port", str(port), "--request-timeout",
                     str(DEADLINE), *flags)
        assert wait_until(lambda: dep.listed("mdns,dir") >= dep.ids("a2", "b1", "b2"), 30)
        dep.model = dep.client("dir").models.list().data[0].id
        yield dep


def test_the_hosts_are_on_two_subnets_joined_by_a_router(subnets: Subnets) -> None:
    a1, b1 = subnets.cluster["a1"], subnets.cluster["b1"]
    assert a1.address.rsplit(".", 1)[0] != b1.address.rsplit(".", 1)[0]
    assert subnets.cluster.router_netns is not None


def test_mdns_alone_does_not_cross_the_router(subnets: Subnets) -> None:
    assert wait_until(lambda: subnets.ids("a2") <= subnets.listed("mdns"), 30)
    time.sleep(5.0)  # B's workers announce and answer queries all this time, on B only
    assert subnets.listed("mdns") == subnets.ids("a2")


def test_the_directory_crosses_it(subnets: Subnets) -> None:
    assert wait_until(lambda: subnets.listed("dir") == subnets.ids("b1", "b2"), 30)
    adverts = {p.name for p in subnets.shared.glob("*.json")}
    assert {f"{i:016x}" for i in subnets.ids("b1", "b2")} <= {a[-21:-5] for a in adverts}
    client, seen = subnets.client("dir"), set()

    def both_serve() -> bool:
        raw = client.completions.with_raw_response.create(
            model=subnets.model, prompt="hello", max_tokens=2)
        raw.parse()
        seen.add(served_by(raw))
        return seen == subnets.ids("b1", "b2")

    assert wait_until(both_serve, 30, step=0.0)


def test_a_frontend_with_both_finds_its_subnet_by_mdns_and_the_rest_by_the_directory(
    subnets: Subnets,
) -> None:
    assert subnets.listed("mdns,dir") == subnets.ids("a2", "b1", "b2")
    client, seen = subnets.client("mdns,dir"), set()

    def all_serve() -> bool:
        raw = client.completions.with_raw_response.create(
            model=subnets.model, prompt="hello", max_tokens=2)
        raw.parse()
        seen.add(served_by(raw))
        return seen == subnets.ids("a2", "b1", "b2")

    assert wait_until(all_serve, 30, step=0.0)


def test_a_worker_killed_mid_stream_across_the_router_loses_no_stream(subnets: Subnets) -> None:
    """Last: it kills b1's worker."""
    client = subnets.client("dir")
    firsts = [threading.Event() for _ in range(STREAMS)]

    def stream(first: threading.Event) -> tuple[int, str, Any]:
        raw = client.completions.with_raw_response.create(
            model=subnets.model, prompt="Once upon", max_tokens=TOKENS, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, usage = "", None
        for chunk in raw.parse():
            usage = chunk.usage or usage
            if chunk.choices:
                text += chunk.choices[0].text
                first.set()
        return served_by(raw), text, usage

    victim = subnets.workers["b1"]
    with ThreadPoolExecutor(STREAMS) as pool:
        futures = [pool.submit(stream, ev) for ev in firsts]
        for ev in firsts:
            assert ev.wait(30), "a stream did not start"
        victim.signal(signal.SIGKILL)
        try:
            outcomes = [f.result(timeout=DEADLINE + 10) for f in futures]
        except openai.APIError as exc:  # a lost stream: the finding
            pytest.fail(f"a stream failed after the kill: {exc!r}")
    assert any(served == victim.instance_id for served, _, _ in outcomes), outcomes
    assert {text for _, text, _ in outcomes} == {outcomes[0][1]}  # one text, as undisturbed
    assert all(u is not None and u.completion_tokens == TOKENS for _, _, u in outcomes)
    assert wait_until(lambda: victim.instance_id not in subnets.listed("dir"), 10)
