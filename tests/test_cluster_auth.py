"""CURVE auth (issue 16) on the multi-host harness: a KV-routing frontend on A and a worker on
B share a key set; a rogue worker on C advertises the same model with its own key. Requests
reach only B, only B's KV events and load are followed, the rogue is reported once, and a
plaintext client on C gets no answer from B."""

from __future__ import annotations

import sys
from pathlib import Path

from dynamo_zmq.tools.keys import authorize, create_keypair
from tests.support.cluster import cluster, complete, frontend, mocker_worker, wait_until
from tests.support.metrics import sample

PROBE = """
import sys, zmq
from dynamo_zmq.wire import Describe, Kind, encode
ctx = zmq.Context(); s = ctx.socket(zmq.DEALER); s.linger = 0; s.sndtimeo = 3000
s.connect(sys.argv[1])
try:
    s.send_multipart([Kind.DESCRIBE, encode(Describe(1))])
except zmq.Again:  # no peer: the handshake failed before the send
    print("silent"); sys.exit()
print("answered" if s.poll(3000) else "silent")
"""


def test_auth_across_hosts(tiny_model: Path, tmp_path: Path) -> None:
    keys, rogue_keys = tmp_path / "cluster", tmp_path / "rogue"
    for name in ("worker", "front"):
        create_keypair(keys, name)
        authorize(keys, str(keys / f"{name}.key"))
    create_keypair(rogue_keys, "rogue")
    for name in ("worker", "front"):  # the rogue trusts the cluster: it would serve it
        authorize(rogue_keys, str(keys / f"{name}.key"))

    with cluster("a", "b", "c") as built:
        worker = mocker_worker(built["b"], tiny_model, "--auth-keys", str(keys),
                               "--auth-key-name", "worker")
        rogue = mocker_worker(built["c"], tiny_model, "--auth-keys", str(rogue_keys),
                              "--auth-key-name", "rogue")
        front = frontend(built["a"], "--router-mode", "kv", "--auth-keys", str(keys),
                         "--auth-key-name", "front")
        client = built["a"].openai_client(8000)
        assert wait_until(lambda: bool(client.models.list().data), 30), "no model through A"
        model = client.models.list().data[0].id

        def rogue_reported() -> bool:
            return f"instance {rogue.instance_id:x}" in Path(front.log.name).read_text()

        assert wait_until(rogue_reported, 20), front.logs()
        served = {complete(client, model) for _ in range(8)}
        assert served == {worker.instance_id}

        http = built["a"].http(8000)

        def followed() -> bool:
            page = http.get("/metrics").text
            replays = sample(page, "dynamo_router_kv_event_replays_total", result="ok")
            loads = sample(page, "dynamo_router_load_reports_total")
            return replays == 1 and (loads or 0) >= 1

        assert wait_until(followed, 15, step=0.2), http.get("/metrics").text[-3000:]
        assert f"{rogue.instance_id:x}" not in http.get("/metrics").text
        text = Path(front.log.name).read_text()
        assert len([ln for ln in text.splitlines()
                    if f"instance {rogue.instance_id:x}" in ln]) == 1, text[-3000:]

        probe = built["c"].run([sys.executable, "-c", PROBE, worker.address], timeout=30)
        assert probe.stdout.strip() == "silent", probe.stderr
