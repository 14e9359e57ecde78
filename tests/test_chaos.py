"""A short chaos run (issue 14 item 6, the CI form of ``scripts/chaos.py``): 4 mocker workers on
2 hosts (network namespaces) behind a frontend, streaming load with the ``openai`` client, and
one fault of each kind (SIGKILL + restart, SIGSTOP + SIGCONT, link cut + heal, SIGTERM +
restart) while it runs. Every request must end with exactly the text, usage and finish reason
of its fault-free reference; faults must have been injected and requests migrated, so the run
cannot pass without exercising what it checks."""

from __future__ import annotations

import pytest

from dynamo_zmq.tools.chaos import ChaosConfig, run_chaos
from dynamo_zmq.tools.chaos_report import reference_problems, stats
from dynamo_zmq.tools.netns import cluster_supported

pytestmark = pytest.mark.skipif(cluster_supported() is not None,
                                reason=f"no network namespaces: {cluster_supported()}")


def test_a_short_chaos_run_loses_nothing(tiny_model):
    config = ChaosConfig(
        worker_hosts=2, workers_per_host=2, concurrency=12, duration=20.0, fault_interval=4.0,
        pool=48, speedup=0.2, baseline=False, model_path=str(tiny_model), seed=1,
        # Shorter than most streams (1-4 s at this speed): SIGTERM must hand some over.
        graceful_timeout=1.0,
    )
    result = run_chaos(config)
    assert reference_problems(result) == []
    chaos = stats(result, result.runs[-1])
    logs = "\n".join(f"===== {k}\n{v[-1500:]}" for k, v in result.worker_logs.items())
    assert chaos.problems == [], f"{chaos.problems}\n{logs}"
    assert chaos.ok == chaos.requests > 0
    assert chaos.faults == {"kill": 1, "stop": 1, "cut": 1, "term": 1}
    assert all(f.recovered for f in result.runs[-1].faults), result.runs[-1].faults
    assert sum(chaos.migrations.values()) > 0, chaos.migrations
