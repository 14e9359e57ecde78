"""Checking and reporting a chaos run (``tools.chaos``): each request against the fault-free
reference of its prompt, latency and throughput per run, a table, a plot.

A request that ended normally is ``wrong`` when its text, usage or finish reason differs from
its prompt's reference: tokens lost or repeated (``token_delta``: its ``completion_tokens``
minus the reference's; ``chunk_delta``: text chunks received minus the reference's).
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Sequence

import msgspec

from .chaos import ChaosResult, RunResult
from .chaos_load import Record

__all__ = ["Problem", "RunStats", "check", "format_table", "plot", "stats"]


class Problem(msgspec.Struct):
    """A request that failed, hung or was wrong, with the fault it is laid at (the last
    fault injected before it ended; empty in a fault-free run)."""

    index: int
    prompt: int
    status: str
    fault: str
    error: str = ""
    token_delta: int = 0
    chunk_delta: int = 0
    first_difference: int = -1
    worker: str = ""


class RunStats(msgspec.Struct):
    """One run's numbers."""

    name: str
    requests: int
    ok: int
    failed: int
    hung: int
    wrong: int
    tokens_lost: int
    tokens_duplicated: int
    ttft_ms: tuple[float, float]
    itl_ms: tuple[float, float]
    tokens_per_s: float
    requests_per_s: float
    per_second_tokens: list[int]
    per_second_requests: list[int]
    migrations: dict[str, float]
    faults: dict[str, int]
    problems_by_fault: dict[str, int]
    client_cpu: float
    machine_cpu: float
    problems: list[Problem]


def _records(run: RunResult) -> list[Record]:
    return [r for load in run.loads for r in load.records]


def reference_problems(result: ChaosResult) -> list[str]:
    """What is wrong with the reference pass itself (it must be complete and fault-free)."""
    found = []
    for rec in _records(result.reference):
        want = result.prompts[rec.prompt].max_tokens
        if rec.status != "ok" or rec.completion_tokens != want or rec.finish_reason != "length":
            found.append(f"prompt {rec.prompt}: {rec.status} {rec.error} "
                         f"completion_tokens={rec.completion_tokens} (want {want}) "
                         f"finish={rec.finish_reason}")
    return found


def check(result: ChaosResult, run: RunResult) -> list[Problem]:
    """Every request of ``run`` that failed, hung or differs from its reference."""
    refs = {r.prompt: r for r in _records(result.reference) if r.status == "ok"}
    problems = []
    for rec in _records(run):
        fault = _fault_of(run, rec)
        if rec.status != "ok":
            problems.append(Problem(rec.index, rec.prompt, rec.status, fault, rec.error,
                                    worker=rec.worker))
            continue
        ref = refs.get(rec.prompt)
        if ref is None:
            problems.append(Problem(rec.index, rec.prompt, "wrong", fault, "no reference"))
            continue
        if (rec.text, rec.completion_tokens, rec.prompt_tokens, rec.finish_reason) != (
                ref.text, ref.completion_tokens, ref.prompt_tokens, ref.finish_reason):
            first = next((i for i, (a, b) in enumerate(zip(rec.text, ref.text, strict=False))
                          if a != b), min(len(rec.text), len(ref.text)))
            problems.append(Problem(
                rec.index, rec.prompt, "wrong", fault,
                f"finish {rec.finish_reason} (reference {ref.finish_reason}), prompt_tokens "
                f"{rec.prompt_tokens} (reference {ref.prompt_tokens})",
                rec.completion_tokens - ref.completion_tokens, len(rec.times) - len(ref.times),
                first, rec.worker))
    return problems


def _fault_of(run: RunResult, rec: Record) -> str:
    before = [f for f in run.faults if f.start <= rec.end]
    return f"{before[-1].kind} {before[-1].target}" if before else ""


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def stats(result: ChaosResult, run: RunResult) -> RunStats:
    """``run``'s numbers; throughput per second counts text chunks (tokens) and requests
    ending in each second from the run's start, over its duration."""
    recs = _records(run)
    problems = check(result, run)
    status = Counter(p.status for p in problems)
    ok = [r for r in recs if r.status == "ok"]
    ttft = [(r.times[0] - r.start) * 1000 for r in ok if r.times]
    itl = [(b - a) * 1000 for r in ok for a, b in zip(r.times, r.times[1:], strict=False)]
    seconds = max(1, math.ceil(run.duration))
    tokens, done = [0] * seconds, [0] * seconds
    for r in recs:
        for t in r.times:
            k = int(t - run.start)
            if 0 <= k < seconds:
                tokens[k] += 1
        k = int(r.end - run.start)
        if r.status == "ok" and 0 <= k < seconds:
            done[k] += 1
    wrong = [p for p in problems if p.status == "wrong"]
    by_fault = Counter(p.fault.split(" ")[0] for p in problems if p.fault)
    return RunStats(
        name=run.name, requests=len(recs), ok=len(recs) - len(problems),
        failed=status["failed"], hung=status["hung"], wrong=status["wrong"],
        tokens_lost=-sum(min(0, p.token_delta) for p in wrong),
        tokens_duplicated=sum(max(0, p.token_delta) for p in wrong),
        ttft_ms=(_pct(ttft, 0.5), _pct(ttft, 0.99)), itl_ms=(_pct(itl, 0.5), _pct(itl, 0.99)),
        tokens_per_s=sum(tokens) / seconds, requests_per_s=sum(done) / seconds,
        per_second_tokens=tokens, per_second_requests=done, migrations=dict(run.migrations),
        faults=dict(Counter(f.kind for f in run.faults)), problems_by_fault=dict(by_fault),
        client_cpu=sum(x.cpu_seconds for x in run.loads) / max(
            1e-9, max(x.wall_seconds for x in run.loads)),
        machine_cpu=run.machine_cpu,
        problems=problems,
    )


def _kinds(counts: dict[str, int] | dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(counts.items())) or "0"


def format_table(runs: Sequence[RunStats]) -> str:
    """A Markdown table, one column per run."""
    rows: list[tuple[str, list[str]]] = [
        ("requests", [str(s.requests) for s in runs]),
        ("ok", [str(s.ok) for s in runs]),
        ("failed", [str(s.failed) for s in runs]),
        ("hung", [str(s.hung) for s in runs]),
        ("wrong (text or usage differs)", [str(s.wrong) for s in runs]),
        ("tokens lost / duplicated", [f"{s.tokens_lost} / {s.tokens_duplicated}" for s in runs]),
        ("faults injected", [_kinds(s.faults) for s in runs]),
        ("problems by last fault", [_kinds(s.problems_by_fault) for s in runs]),
        ("migrations (by reason)",
         [f"{sum(s.migrations.values()):g} ({_kinds(s.migrations)})" if s.migrations else "0"
          for s in runs]),
        ("TTFT p50 / p99 (ms)", [f"{s.ttft_ms[0]:.1f} / {s.ttft_ms[1]:.1f}" for s in runs]),
        ("ITL p50 / p99 (ms)", [f"{s.itl_ms[0]:.1f} / {s.itl_ms[1]:.1f}" for s in runs]),
        ("output tokens/s", [f"{s.tokens_per_s:.0f}" for s in runs]),
        ("completed requests/s", [f"{s.requests_per_s:.1f}" for s in runs]),
        ("lowest tokens/s in a second (after the first 2 s)",
         [str(min(s.per_second_tokens[2:] or s.per_second_tokens)) for s in runs]),
        ("load generator CPU (cores)", [f"{s.client_cpu:.2f}" for s in runs]),
        (f"machine CPU busy (of {os.cpu_count()} cores)",
         [f"{s.machine_cpu:.0%}" for s in runs]),
    ]
    head = "| | " + " | ".join(s.name for s in runs) + " |"
    sep = "|---|" + "---|" * len(runs)
    return "\n".join([head, sep, *(f"| {k} | " + " | ".join(v) + " |" for k, v in rows)])


def plot(result: ChaosResult, runs: Sequence[RunStats], path: str) -> None:
    """Tokens/s per second of each run, faults of the chaos run as labelled vertical lines.
    Needs matplotlib (the ``bench`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"kill": "tab:red", "stop": "tab:purple", "cut": "tab:orange", "term": "tab:green"}
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for s in runs:
        ys = s.per_second_tokens
        ax.step(range(len(ys) + 1), [*ys, ys[-1]], where="post", label=s.name)
    top = max((max(s.per_second_tokens, default=0) for s in runs), default=1) or 1
    chaos = next((r for r in result.runs if r.faults), None)
    if chaos is not None:
        for f in chaos.faults:
            x = f.start - chaos.start
            ax.axvline(x, color=colors.get(f.kind, "gray"), linestyle="--", linewidth=1)
            ax.text(x, top * 1.02, f"{f.kind}\n{f.target}", fontsize=7, ha="center",
                    va="bottom", color=colors.get(f.kind, "gray"))
    ax.set_xlabel("seconds from the run's start")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(0, top * 1.2)
    ax.legend(loc="lower left")
    ax.set_title("Chaos: throughput per second, faults marked", pad=28)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
