"""A multi-homed worker host (issue 33 item 3), on namespace hosts.

Host W has two links, one on each of two subnets that nothing routes between; F0 is on the
first subnet only, F1 on the second only. Each runs a kv-mode frontend. On W, with no flag: a
mocker worker A (it binds every interface and advertises both addresses), a worker P pinned
with ``--advertise-host`` to W's second address, and a prefill worker of model ``dis`` whose
decode worker runs on F1.

A worker advertises its request plane at both addresses, but its KV-event, replay, load and KV
transfer endpoints at one of them (the first): before the fix the frontend on the other subnet
routed to A but never received its KV events or load, and the decode worker could not pull the
prefill worker's KV. Now a caller dials those endpoints at the address it reached the request
plane at (``Description.hosts``, ``transport.endpoint_via``), a KV-transfer ticket names every
address (the decode worker dials one on its own network), and ``--advertise-host`` pins them all.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dynamo_zmq.tools.child_process import ChildProcess
from tests.support.cluster import Cluster, cluster, frontend, mocker_worker, served_by, wait_until
from tests.support.metrics import sample

BLOCK = 16
WORKER = ("--block-size", str(BLOCK))


@dataclass
class MultiHomed:
    cluster: Cluster
    workers: dict[str, ChildProcess]
    model: str = ""

    def metrics(self, front: str) -> str:
        return str(self.cluster[front].http(8000).get("/metrics").text)

    def routed(self, front: str) -> set[int]:
        resp = self.cluster[front].http(8000).get("/health")
        if resp.status_code != 200:
            return set()
        return {int(i, 16) for ids in resp.json()["models"].values() for i in ids}


@pytest.fixture(scope="module")
def multihomed(tiny_model: Path) -> Iterator[MultiHomed]:
    with cluster("w", "f0", "f1", subnets={"w": (0, 1), "f1": 1}, routed=False) as built:
        w = built["w"]
        assert len(w.addresses) == 2
        disagg = ("--model-name", "dis", "--disaggregation-mode")
        dep = MultiHomed(built, {
            "a": mocker_worker(w, tiny_model, *WORKER),
            "p": mocker_worker(w, tiny_model, *WORKER, "--advertise-host", w.addresses[1]),
            "prefill": mocker_worker(w, tiny_model, *WORKER, *disagg, "prefill"),
            "decode": mocker_worker(built["f1"], tiny_model, *WORKER, *disagg, "decode",
                                    env={"DYN_SYSTEM_PORT": "9100"}),
        })
        for front in ("f0", "f1"):
            frontend(built[front], "--router-mode", "kv", "--disagg-mode", "always")
        a, p = dep.workers["a"].instance_id, dep.workers["p"].instance_id
        assert wait_until(lambda: a in dep.routed("f0") and {a, p} <= dep.routed("f1"), 30), (
            dep.routed("f0"), dep.routed("f1"))
        dep.model = next(iter(
            m.id for m in built["f0"].openai_client(8000).models.list().data if m.id != "dis"))
        yield dep


def _serve_each(dep: MultiHomed, front: str, want: set[int]) -> None:
    """Send multi-block prompts through ``front`` until each of ``want`` served one."""
    client = dep.cluster[front].openai_client(8000)
    seen: set[int] = set()
    for i in range(40):
        prompt = [10 + (i * 31 + j * 7) % 400 for j in range(3 * BLOCK)]
        raw = client.completions.with_raw_response.create(model=dep.model, prompt=prompt,
                                                          max_tokens=2)
        raw.parse()
        seen.add(served_by(raw))
        if seen >= want:
            return
    raise AssertionError(f"requests through {front} reached {seen}, not all of {want}")


@pytest.mark.parametrize("front", ["f0", "f1"])
def test_frontends_on_both_networks_follow_its_kv_events_and_load(
    multihomed: MultiHomed, front: str
) -> None:
    dep = multihomed
    want = {dep.workers["a"].instance_id}
    if front == "f1":  # P is pinned to W's address on the second subnet
        want.add(dep.workers["p"].instance_id)
    _serve_each(dep, front, want)

    def followed() -> bool:
        page = dep.metrics(front)
        blocks = {w: sample(page, "dynamo_router_kv_index_blocks", model=dep.model,
                            worker=f"{w:x}") or 0 for w in want}
        loads = {w: sample(page, "dynamo_router_reported_active_blocks", model=dep.model,
                           worker=f"{w:x}") for w in want}
        replays = sample(page, "dynamo_router_kv_event_replays_total", model=dep.model,
                         result="ok")
        return (all(b > 0 for b in blocks.values()) and None not in loads.values()
                and replays == len(want))

    assert wait_until(followed, 20, step=0.2), dep.metrics(front)[-4000:]
    page = dep.metrics(front)
    assert not sample(page, "dynamo_router_kv_event_replays_total", model=dep.model,
                      result="failed")


def test_a_pinned_worker_is_advertised_at_its_pin_only(multihomed: MultiHomed) -> None:
    dep = multihomed
    w, p = dep.cluster["w"], dep.workers["p"].instance_id
    done = dep.cluster["f1"].run(
        [sys.executable, "-m", "tests.support.mdns_browse", "15", f"{p:016x}"], timeout=30)
    assert done.returncode == 0, done.stderr
    records = {r["iid"]: r for r in json.loads(done.stdout)}
    assert records[f"{p:016x}"]["addresses"] == [w.addresses[1]]
    assert p not in dep.routed("f0")  # its only address is not on F0's network


def test_a_decode_worker_on_the_other_network_pulls_the_prefilled_kv(
    multihomed: MultiHomed,
) -> None:
    dep = multihomed
    client = dep.cluster["f1"].openai_client(8000)
    assert wait_until(lambda: "dis" in {m.id for m in client.models.list().data}, 30)
    decode = dep.cluster["f1"].http(9100)

    def engine(name: str) -> float:
        return sample(decode.get("/metrics").text, name) or 0.0

    def served() -> bool:
        out: Any = client.completions.create(
            model="dis", prompt=[10 + j % 300 for j in range(4 * BLOCK)], max_tokens=3)
        return bool(out.choices) and engine("mocker_remote_prefills_total") >= 1

    # (the frontend follows the prefill pool a moment after it lists the model)
    assert wait_until(served, 30, step=0.5), dep.workers["decode"].logs()[-3000:]
    assert engine("mocker_remote_prefill_fallbacks_total") == 0, (
        dep.workers["decode"].logs()[-3000:])
