"""A short chaos run (issue 14 item 6, the CI form of ``scripts/chaos.py``): 4 mocker workers on
2 hosts (network namespaces) behind a frontend, streaming load with the ``openai`` client, and
one fault of each kind (SIGKILL + restart, SIGSTOP + SIGCONT, link cut + heal, SIGTERM +
restart) while it runs. Every request must end with exactly the text, usage and finish reason
of its fault-free reference; faults must have been injected and requests migrated, so the run
cannot pass without exercising what it checks."""

from __future__ import annotations

from dynamo_zmq.tools.chaos import ChaosConfig, run_chaos
from dynamo_zmq.tools.chaos_report import reference_problems, stats
from tests.support.cluster import require_cluster


def test_a_short_chaos_run_loses_nothing(tiny_model):
    require_cluster()
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


def test_the_checker_finds_lost_and_repeated_tokens():
    """The verdicts the chaos run relies on, on records made by hand: text or usage that
    differs from the prompt's reference is wrong (with the token difference), an error is
    failed, a request past its deadline is hung."""
    from dynamo_zmq.tools.chaos import ChaosResult, RunResult, make_prompts
    from dynamo_zmq.tools.chaos_load import LoadResult, Record
    from dynamo_zmq.tools.chaos_report import check

    prompts = make_prompts(2, 3, 3, seed=0)

    def rec(index, prompt, text, tokens, status="ok"):
        return Record(index, prompt, status, 0.0, 1.0, text, [0.1 * i for i in range(tokens)],
                      tokens, 5, "length")

    reference = RunResult("reference", 0.0, 0.0, [LoadResult(
        [rec(0, 0, "abc", 3), rec(1, 1, "xyz", 3)], 0.0, 0.0, 1.0)])
    run = RunResult("chaos", 0.0, 10.0, [LoadResult([
        rec(0, 0, "abc", 3), rec(1, 1, "xz", 2), rec(2, 0, "abbc", 4),
        rec(3, 1, "", 0, status="failed"), rec(4, 0, "a", 1, status="hung"),
    ], 0.0, 0.0, 1.0)])
    result = ChaosResult(config={}, prompts=prompts, reference=reference, runs=[run])
    found = {p.index: (p.status, p.token_delta, p.first_difference) for p in check(result, run)}
    assert found == {1: ("wrong", -1, 1), 2: ("wrong", 1, 2), 3: ("failed", 0, -1),
                     4: ("hung", 0, -1)}
