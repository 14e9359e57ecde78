"""A rogue host on the multi-host harness (issue 33, items 5 and 7): a frontend on A and a
worker on B share a key set with roles; C is a rogue host holding a copy of the frontend's
key (a stolen frontend key) and running its own mDNS responder.

- C serves the model with the frontend's key: A never routes to it and says so once.
- C's responder claims B's mDNS service name with C's address: B never stops, says so once
  and announces itself under a new name; A keeps routing every request to B, during the claim
  and after the claiming records expire.
- B's system port (metrics, health) binds loopback unless ``--system-host`` says otherwise: C
  cannot read B's, B itself can, and C's own, bound with ``--system-host 0.0.0.0``, answers
  from A.
"""

from __future__ import annotations

import shutil
import signal
import sys
import time
from pathlib import Path

from dynamo_zmq.discovery.mdns import instance_name
from dynamo_zmq.tools.keys import authorize, create_keypair
from tests.support.cluster import cluster, complete, frontend, mocker_worker, wait_until

FETCH = """
import sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=5) as r:
        print("answered", r.status)
except OSError as exc:
    print("refused", exc)
"""
CLAIM_TTL = 8  # seconds the rogue's records live in caches


def fetch(host, url: str) -> str:
    """``GET url`` from ``host``: ``answered 200`` or ``refused ...``."""
    return host.run([sys.executable, "-c", FETCH, url], timeout=30).stdout.strip()


def test_a_rogue_host_cannot_serve_claim_a_name_or_read_metrics(tiny_model: Path,
                                                                tmp_path: Path) -> None:
    keys, stolen = tmp_path / "cluster", tmp_path / "stolen"
    for name, role in (("worker", "worker"), ("front", "frontend")):
        create_keypair(keys, name)
        authorize(keys, str(keys / f"{name}.key"), roles=frozenset({role}))
    shutil.copytree(keys, stolen)  # C holds the frontend's keypair and the authorized set

    with cluster("a", "b", "c") as built:
        a, b, c = built["a"], built["b"], built["c"]
        worker = mocker_worker(b, tiny_model, "--auth-keys", str(keys), "--auth-key-name",
                               "worker", "--system-port", "9100")
        rogue = mocker_worker(c, tiny_model, "--auth-keys", str(stolen), "--auth-key-name",
                              "front", "--system-port", "9101", "--system-host", "0.0.0.0")
        front = frontend(a, "--auth-keys", str(keys), "--auth-key-name", "front")
        client = a.openai_client(8000)
        assert wait_until(lambda: bool(client.models.list().data), 30), front.logs()
        model = client.models.list().data[0].id
        refused = "advertises a model, but its key front holds frontend, not worker"
        assert wait_until(lambda: refused in front.logs(), 30), front.logs()[-3000:]
        assert f"instance {rogue.instance_id:x} at tcp://{c.address}:" in front.logs()
        assert {complete(client, model) for _ in range(6)} == {worker.instance_id}

        # The system ports: B's only from B, C's (bound to every address) from anywhere.
        assert fetch(c, f"http://{b.address}:9100/metrics").startswith("refused")
        assert fetch(b, "http://127.0.0.1:9100/metrics") == "answered 200"
        assert fetch(a, f"http://{c.address}:9101/health") == "answered 200"

        # C's responder claims B's service name, with C's address.
        port = worker.address.rsplit(":", 1)[1]
        claim = c.python("-m", "tests.support.mdns_record", "dynamo", f"{worker.instance_id:x}",
                         f"tcp://{c.address}:{port}", "backend", "--interface", c.address,
                         "--ttl", str(CLAIM_TTL))
        renamed = f"as {instance_name('dynamo', worker.instance_id, 2)} from now on"
        assert wait_until(lambda: renamed in worker.logs(), 30), worker.logs()[-3000:]
        claimed_at = time.monotonic()
        served = set()
        while time.monotonic() - claimed_at < CLAIM_TTL + 4:  # the claim, then its expiry
            served.add(complete(client, model))
        claim.signal(signal.SIGKILL)  # no goodbye: the claiming records expire by themselves
        while time.monotonic() - claimed_at < 2 * CLAIM_TTL + 4:
            served.add(complete(client, model))
        assert served == {worker.instance_id}
        assert worker.running(), worker.logs()[-3000:]
        assert worker.logs().count("another responder claims") == 1, worker.logs()[-3000:]
        assert front.logs().count(refused) == 1, front.logs()[-3000:]
        said = front.logs().count("a conflicting record (a stray or cloned responder?)")
        assert said <= 1, front.logs()[-3000:]
        health = a.http(8000).get("/health").json()
        assert health["models"][model] == [f"{worker.instance_id:x}"], health
