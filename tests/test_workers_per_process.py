"""``python -m dynamo_zmq.worker --workers-per-process N``: N workers in one process, each with
its own engine, runtime, sockets, instance id and advert, so that a frontend and a KV router
cannot tell them from N processes (the test fleets of scripts/fleet.py use it); one SIGTERM
drains them all. Fixed ports are refused (the workers would share them). Plus the fleet probes'
histogram quantile against a brute-force count.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_zmq.tools.fleet import spread
from dynamo_zmq.tools.fleet_probes import quantile
from tests.support.http_calls import get
from tests.support.procs import Proc

N = 3


def test_n_workers_in_one_process_look_like_n_processes(tiny_model: Path, namespace: str):
    worker = Proc(["-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path",
                   str(tiny_model), "--model-name", "tiny", "--namespace", namespace,
                   "--host", "127.0.0.1", "--workers-per-process", str(N),
                   "--speedup-ratio", "100"])
    front = Proc(["-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace", namespace,
                  "--router-mode", "kv"])
    try:
        worker.wait_ready(60, count=N)
        assert len(set(worker.instance_ids)) == N and len(set(worker.addresses)) == N
        front.wait_ready(60)
        deadline, listed = time.monotonic() + 30, set()
        while time.monotonic() < deadline and listed != set(worker.instance_ids):
            status, body = get(f"{front.address}/health")
            if status == 200:
                listed = {int(i, 16) for i in json.loads(body)["models"]["tiny"]}
            time.sleep(0.2)
        assert listed == set(worker.instance_ids)
        text = get(f"{front.address}/metrics")[1].decode()
        # The KV router follows each as an instance of its own: its load reports arrive.
        for iid in worker.instance_ids:
            assert f'worker="{iid:x}"' in text
        worker.signal(signal.SIGTERM)
        assert worker.wait(30) == 0
        assert worker.logs().count("worker stopped") == N
    finally:
        worker.stop()
        front.stop()


def test_several_workers_in_a_process_refuse_a_fixed_port(tiny_model: Path):
    done = subprocess.run(
        [sys.executable, "-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path",
         str(tiny_model), "--workers-per-process", "2", "--port", "5555", "--load-port", "0"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--workers-per-process 2 needs every port to be 0" in done.stderr
    assert "--port 5555" in done.stderr


def test_a_worker_count_spreads_evenly():
    assert spread(10, 4) == [3, 3, 2, 2] and spread(3, 5) == [1, 1, 1, 0, 0]
    assert sum(spread(256, 8)) == 256


BOUNDS = (0.001, 0.002, 0.005, 0.01, float("inf"))


def scrape(values: list[float]) -> dict:
    """What a Prometheus histogram over ``values`` exposes: cumulative buckets."""
    return {("h_bucket", frozenset({("le", str(b)), ("model", "m")})):
            float(sum(v <= b for v in values)) for b in BOUNDS}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 0.02), min_size=1, max_size=50),
       st.lists(st.floats(0.0, 0.02), max_size=50), st.sampled_from([0.5, 0.9, 0.99]))
def test_the_quantile_of_a_window_lies_in_the_bucket_of_the_true_one(before, during, q):
    """Only what was observed between the two scrapes counts, and the answer lies in the
    bucket holding the true quantile of those observations."""
    got = quantile(scrape(before), scrape(before + during), "h", q)
    if not during:
        assert got is None
        return
    ordered = sorted(during)
    true = ordered[max(0, int(-(-q * len(ordered) // 1)) - 1)]
    upper = next(b for b in BOUNDS if true <= b)
    lower = max([0.0, *(b for b in BOUNDS if b < upper)])
    assert got is not None and lower <= got <= min(upper, BOUNDS[-2])
