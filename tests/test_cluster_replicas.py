"""Router replica sync across hosts (issue 18, item 4) on the multi-host harness: a slow mocker
worker on B; a kv-mode frontend with ``--router-replica-sync`` on A, streaming a request; a
second one started on D while that request is in flight. D counts the request from its
snapshot of A (asked over the request plane at the address A advertised), then hears A's later
routing over A's replica PUB socket across the bridge, and releases the stream's request when
the client closes it. Every process starts with no discovery flag and no ``DYN_*`` variable.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.cluster import cluster, complete, frontend, mocker_worker, wait_until
from tests.support.metrics import sample

KV_SYNC = ("--router-mode", "kv", "--router-replica-sync")


def test_a_replica_on_another_host_counts_what_was_in_flight(tiny_model: Path) -> None:
    with cluster("a", "b", "d") as built:
        # A twentieth of the mocker's speed: the stream outlives D's start on a slow machine.
        worker = mocker_worker(built["b"], tiny_model, "--speedup-ratio", "0.05")
        front_a = frontend(built["a"], *KV_SYNC)
        client = built["a"].openai_client(8000, timeout=120.0)
        assert wait_until(lambda: bool(client.models.list().data), 30), front_a.logs()
        model = client.models.list().data[0].id
        stream = client.completions.create(model=model, prompt="hello there " * 40,
                                           max_tokens=1800, stream=True)
        try:
            assert next(iter(stream)).choices  # routed and generating
            front_d = frontend(built["d"], *KV_SYNC)
            http = built["d"].http(8000)

            def on_d(name: str, **labels: str) -> float:
                return sample(http.get("/metrics").text, name, **labels) or 0.0

            assert wait_until(lambda: on_d("dynamo_router_replica_requests") == 1, 30,
                              step=0.2), front_d.logs()
            assert on_d("dynamo_router_replica_snapshots_total", outcome="applied") >= 1
            assert on_d("dynamo_router_replica_active_blocks",
                        worker=f"{worker.instance_id:x}", dp_rank="0") >= 1
            # Its ADD went out once, before D existed: the snapshot brought it.
            assert on_d("dynamo_router_replica_events_received_total", kind="add") == 0
            # A request A routes now reaches D as events over A's PUB socket.
            assert complete(client, model) == worker.instance_id
            assert wait_until(lambda: on_d("dynamo_router_replica_events_received_total",
                                           kind="free") >= 1, 30, step=0.2)
            assert on_d("dynamo_router_replica_events_received_total", kind="add") == 1
        finally:
            stream.close()
        assert wait_until(lambda: on_d("dynamo_router_replica_requests") == 0, 30, step=0.2)
        assert not on_d("dynamo_router_replica_active_blocks",
                        worker=f"{worker.instance_id:x}", dp_rank="0")
        assert "Traceback" not in front_a.logs() + front_d.logs()
