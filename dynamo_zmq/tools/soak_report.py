"""The soak's judgement and report: each process's RSS and open-fd series, their slopes after
the warm-up, the verdict against the bounds, a table and a plot.

A slope is the Theil-Sen estimate (the median of the slopes between every pair of samples):
one spike, such as a burst of connections while a worker restarts, moves it little, where a
least-squares line would follow it; a steady leak moves it fully.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import msgspec

__all__ = [
    "Bounds",
    "ProcessSeries",
    "SoakResult",
    "Verdict",
    "format_table",
    "judge",
    "plot",
    "theil_sen",
]

_HOUR = 3600.0


class ProcessSeries(msgspec.Struct):
    """One process's samples: ``t`` seconds since the load started, RSS in MB, open fds.

    ``judged`` is False for a process that is restarted during the run (its series is one
    incarnation's after another: reported, not fitted)."""

    name: str
    judged: bool = True
    t: list[float] = msgspec.field(default_factory=list)
    rss_mb: list[float] = msgspec.field(default_factory=list)
    fds: list[int] = msgspec.field(default_factory=list)


class Bounds(msgspec.Struct, frozen=True):
    """What the soak fails on: slopes per hour after ``warmup`` seconds, the KV index size."""

    warmup: float
    max_rss_mb_per_hour: float
    max_fds_per_hour: float
    kv_index_max_blocks: int


class SoakResult(msgspec.Struct):
    """Everything a soak run measured."""

    minutes: float
    requests: int = 0
    ok: int = 0
    errors: int = 0
    disconnects: int = 0
    restarts: int = 0
    first_errors: list[str] = msgspec.field(default_factory=list)
    processes: list[ProcessSeries] = msgspec.field(default_factory=list)
    #: The largest KV index (blocks, all workers) seen by each router: ``{name: [blocks]}``.
    kv_index: dict[str, list[float]] = msgspec.field(default_factory=dict)


class Verdict(msgspec.Struct):
    """Per process: its slopes (None when not judged or too few samples); the failures."""

    slopes: dict[str, tuple[float | None, float | None]]
    failures: list[str]

    @property
    def passed(self) -> bool:
        return not self.failures


def theil_sen(t: Sequence[float], y: Sequence[float]) -> float | None:
    """The median of the pairwise slopes ``(y[j] - y[i]) / (t[j] - t[i])`` (None: fewer than
    two samples at distinct times)."""
    slopes = [
        (y[j] - y[i]) / (t[j] - t[i])
        for i in range(len(t)) for j in range(i + 1, len(t)) if t[j] != t[i]
    ]
    return statistics.median(slopes) if slopes else None


def _after(series: ProcessSeries, warmup: float) -> tuple[list[float], list[float], list[float]]:
    keep = [i for i, t in enumerate(series.t) if t >= warmup]
    return ([series.t[i] for i in keep], [series.rss_mb[i] for i in keep],
            [float(series.fds[i]) for i in keep])


def judge(result: SoakResult, bounds: Bounds) -> Verdict:
    """The slopes of the judged processes after the warm-up (per hour), and what failed:
    a slope above its bound, a KV index past its cap, a request that failed."""
    slopes: dict[str, tuple[float | None, float | None]] = {}
    failures: list[str] = []
    for s in result.processes:
        if not s.judged:
            slopes[s.name] = (None, None)
            continue
        t, rss, fds = _after(s, bounds.warmup)
        rss_slope, fd_slope = theil_sen(t, rss), theil_sen(t, fds)
        rss_h = None if rss_slope is None else rss_slope * _HOUR
        fds_h = None if fd_slope is None else fd_slope * _HOUR
        slopes[s.name] = (rss_h, fds_h)
        if rss_h is None or fds_h is None:
            failures.append(f"{s.name}: fewer than two samples after the warm-up")
            continue
        if rss_h > bounds.max_rss_mb_per_hour:
            failures.append(f"{s.name}: RSS grows {rss_h:.1f} MB/h "
                            f"(bound {bounds.max_rss_mb_per_hour:g})")
        if fds_h > bounds.max_fds_per_hour:
            failures.append(f"{s.name}: open fds grow {fds_h:.1f}/h "
                            f"(bound {bounds.max_fds_per_hour:g})")
    for name, blocks in result.kv_index.items():
        if blocks and max(blocks) > bounds.kv_index_max_blocks:
            failures.append(f"{name}: KV index reached {max(blocks):.0f} blocks "
                            f"(cap {bounds.kv_index_max_blocks})")
    if result.errors:
        failures.append(f"{result.errors} requests failed (first: {result.first_errors[:3]})")
    if not result.ok:
        failures.append("no request completed")
    return Verdict(slopes, failures)


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(result: SoakResult, verdict: Verdict, bounds: Bounds) -> str:
    """A markdown table: per process its RSS and fds at the start and end and their slopes
    after the warm-up; then the load's counts and the verdict."""
    lines = [
        f"soak: {result.minutes:g} min, warm-up {bounds.warmup:g} s; {result.requests} requests "
        f"({result.ok} ok, {result.errors} failed, {result.disconnects} client disconnects), "
        f"{result.restarts} worker restarts",
        "",
        "| process | RSS MB first / last | RSS MB/h after warm-up | fds first / last "
        "| fds/h after warm-up |",
        "|---|---|---|---|---|",
    ]
    for s in result.processes:
        rss_h, fds_h = verdict.slopes.get(s.name, (None, None))
        judged = "" if s.judged else " (restarted: not judged)"
        rss = f"{_fmt(s.rss_mb[0])} / {_fmt(s.rss_mb[-1])}" if s.rss_mb else "-"
        fds = f"{s.fds[0]} / {s.fds[-1]}" if s.fds else "-"
        lines.append(f"| {s.name}{judged} | {rss} | {_fmt(rss_h, 2)} | {fds} | {_fmt(fds_h, 2)} |")
    for name, blocks in result.kv_index.items():
        if blocks:
            lines.append(f"\nKV index of {name}: max {max(blocks):.0f} blocks, last "
                         f"{blocks[-1]:.0f} (cap {bounds.kv_index_max_blocks})")
    lines.append("")
    lines.append(
        f"bounds: RSS {bounds.max_rss_mb_per_hour:g} MB/h, fds {bounds.max_fds_per_hour:g}/h")
    lines.append("PASS" if verdict.passed else "FAIL\n  " + "\n  ".join(verdict.failures))
    return "\n".join(lines)


def plot(result: SoakResult, bounds: Bounds, path: str) -> None:
    """RSS and open fds of every process over time, the warm-up shaded. Needs matplotlib (the
    ``bench`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    for s in result.processes:
        minutes = [t / 60 for t in s.t]
        style = "-" if s.judged else ":"
        top.plot(minutes, s.rss_mb, style, label=s.name)
        bottom.plot(minutes, s.fds, style, label=s.name)
    for ax in (top, bottom):
        ax.axvspan(0, bounds.warmup / 60, color="0.9", label="_warm-up")
        ax.grid(alpha=0.3)
    top.set_ylabel("RSS (MB)")
    bottom.set_ylabel("open fds")
    bottom.set_xlabel("minutes")
    top.legend(loc="upper left", fontsize=8, ncol=3)
    top.set_title(f"soak: {result.minutes:g} min, {result.requests} requests, "
                  f"{result.restarts} worker restarts (dotted: restarted, not judged)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
