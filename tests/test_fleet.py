"""A CI-sized fleet (issue 31): 32 mocker workers on 4 namespace hosts (8 worker processes of 4
workers each, every worker its own runtime, sockets, instance id and advert), 2 kv frontends
with replica sync, zero discovery flags. Under streaming load, a worker process holding 4 of the
32 workers (12.5%) is SIGKILLed: those workers leave routing at both frontends, and no request
is lost (the frontends migrate what the dead workers were streaming). scripts/fleet.py measures
the same at 256 workers.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from dynamo_zmq.tools.chaos import make_prompts
from dynamo_zmq.tools.chaos_load import LoadSpec
from dynamo_zmq.tools.fleet import MODEL, Fleet, FleetConfig
from dynamo_zmq.tools.host_calls import HTTP_PORT, run_load
from tests.support.cluster import require_cluster
from tests.support.procs import ROOT, pythonpath

WORKERS, HOSTS, PER_PROCESS, FRONTENDS = 32, 4, 4, 2
LOAD_SECONDS, KILL_AT = 12.0, 4.0


@pytest.fixture
def fleet(tiny_model) -> Fleet:
    require_cluster()
    cfg = FleetConfig(hosts=HOSTS, workers=WORKERS, frontends=FRONTENDS,
                      workers_per_process=PER_PROCESS, speedup=2.0, model_path=str(tiny_model),
                      env={"PYTHONPATH": pythonpath()}, cwd=ROOT)
    with Fleet(cfg) as built:
        yield built


async def test_a_killed_tenth_of_the_fleet_leaves_routing_and_loses_no_request(fleet: Fleet):
    fleet.start_frontends()
    procs = await fleet.start_workers()
    assert len(procs) == WORKERS // PER_PROCESS
    assert len(fleet.live_ids()) == WORKERS  # every worker its own instance id
    await fleet.wait_listed(fleet.live_ids(), timeout=90)

    start_at = time.monotonic() + 4.0  # the load processes import first
    prompts = make_prompts(64, 16, 48, seed=3)
    specs = [LoadSpec(url=f"http://127.0.0.1:{HTTP_PORT}", model=MODEL, prompts=prompts,
                      concurrency=6, duration=LOAD_SECONDS, start_at=start_at, deadline=60.0,
                      margin=15.0, max_requests=2000, offset=i, stride=FRONTENDS)
             for i in range(FRONTENDS)]
    loads = asyncio.gather(*(asyncio.to_thread(run_load, host, spec)
                             for host, spec in zip(fleet.frontend_hosts, specs, strict=True)))

    victim = procs[1]
    gone = set(victim.ids)
    await asyncio.sleep(max(0.0, start_at + KILL_AT - time.monotonic()))
    assert victim.proc is not None
    victim.proc.signal(signal.SIGKILL)
    await fleet.wait_unlisted(gone, timeout=15)  # raises if one stays in routing
    results = await loads

    records = [rec for res in results for rec in res.records]
    failed = [rec for rec in records if rec.status != "ok"]
    assert not failed, failed[:3]
    assert len(records) > 20
    during = [rec for rec in records if rec.start < start_at + KILL_AT < rec.end]
    assert during, "no request was in flight when the workers were killed"
    assert all(rec.completion_tokens == prompts[rec.prompt].max_tokens for rec in records)
    listed = await fleet.listed()
    assert all(seen == fleet.live_ids() for seen in listed)
