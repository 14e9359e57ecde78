#!/usr/bin/env python3
"""Fleet scaling: what W workers cost each frontend, and how fast the fleet forms and heals.
Needs root (network namespaces) and iproute2.

    sudo .venv/bin/python scripts/fleet.py [--sizes 8,32,128,256] [--frontends 1,4]
        [--hosts 8] [--max-processes 64] [--workers-per-process N] [--phases ...]
        [--idle 20] [--load 20] [--concurrency 32] [--churn 60]
        [--worker-args "..."] [--frontend-args "..."] [--plot FILE.png] [--json FILE]

For each size W and frontend count F it builds a fresh fleet (``dynamo_zmq.tools.fleet``): F
frontend hosts with a kv frontend each (replica sync on), ``--hosts`` worker hosts with W mocker
workers as worker processes of ``--workers-per-process`` workers (default: as few as keep the
processes at most ``--max-processes``), zero discovery flags. Then the phases:

- ``cold``: frontends up first, then every worker process launched at once: seconds until the
  last worker is READY (this machine's 2 cores start them one after another) and until every
  frontend lists every worker; ``join``: a frontend started into the running fleet, until it
  lists every worker;
- ``idle`` and ``load`` (steady state, ``--idle`` / ``--load`` seconds; load is streaming chat
  at ``--concurrency`` split over the frontends): per frontend its CPU (% of one core), RSS,
  bytes in on its host, load reports and KV-event batches arriving (messages and bytes a
  second); per worker host its mDNS packets and bytes a second (multicast in, all UDP); the
  worker processes' CPU; in ``load`` the kv routing decision time p50/p99 and requests lost;
- ``kill``: 10% of the workers SIGKILLed at once (whole processes) under load: seconds until
  none is routed to at any frontend, requests lost;
- ``churn``: a worker joins or leaves (SIGTERM; every fourth leave a SIGKILL) every second for
  ``--churn`` seconds under load: requests lost, and stale instances afterwards (``python -m
  dynamo_zmq.status`` listing as serving an instance that is gone, or missing a live one).

It prints one table per phase and, with ``--plot``, draws the curves against W. Results are in
docs/benchmarks.md ("Fleet") with the command that produced them.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import random
import re
import shlex
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dynamo_zmq.tools.chaos import make_prompts
from dynamo_zmq.tools.chaos_load import LoadResult, LoadSpec
from dynamo_zmq.tools.fleet import MODEL, Fleet, FleetConfig, WorkerProcess
from dynamo_zmq.tools.fleet_probes import (
    HostCounters,
    host_counters,
    parse_metrics,
    proc_usage,
    quantile,
    rate,
)
from dynamo_zmq.tools.host_calls import HTTP_PORT, get, instances, run_load
from dynamo_zmq.tools.netns import cluster_supported

PHASES = ("cold", "idle", "load", "decide", "kill", "churn")
#: Seconds between launching the load processes and the load (their imports take a while).
LOAD_DELAY = 4.0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- one measured window ---------------------------------------------------------------------


class Window:
    """Readings at the start and the end of a window: the frontends' usage and metrics, every
    host's counters, the worker processes' CPU."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.t0 = self.t1 = 0.0
        self.before: dict[str, Any] = {}
        self.after: dict[str, Any] = {}

    def _read(self) -> dict[str, Any]:
        fleet = self.fleet
        fronts = [proc_usage(p.pid) for p in fleet.frontends]
        metrics = [parse_metrics(get(h, "/metrics")[1]) for h in fleet.frontend_hosts]
        hosts: dict[str, HostCounters] = {}
        for host in fleet.worker_hosts:
            pid = next((wp.proc.pid for wp in fleet.processes
                        if wp.host is host and wp.alive and wp.proc), None)
            if pid is not None:
                hosts[host.name] = host_counters(pid)
        for host, proc in zip(fleet.frontend_hosts, fleet.frontends, strict=False):
            hosts[host.name] = host_counters(proc.pid)
        workers_cpu = 0.0
        for wp in fleet.processes:
            if wp.alive and wp.proc is not None:
                try:
                    workers_cpu += proc_usage(wp.proc.pid).cpu
                except OSError:
                    pass
        return {"fronts": fronts, "metrics": metrics, "hosts": hosts, "wcpu": workers_cpu,
                "time": time.monotonic()}

    def start(self) -> None:
        self.before = self._read()

    def stop(self) -> dict[str, Any]:
        """The window's figures (rates per second, per frontend and per host)."""
        self.after = a = self._read()
        b = self.before
        secs = a["time"] - b["time"]
        fronts = []
        for i, (u0, u1) in enumerate(zip(b["fronts"], a["fronts"], strict=True)):
            m0, m1 = b["metrics"][i], a["metrics"][i]
            name = self.fleet.frontend_hosts[i].name
            h0, h1 = b["hosts"][name], a["hosts"][name]
            fronts.append({
                "cpu_pct": 100 * (u1.cpu - u0.cpu) / secs,
                "rss_mb": u1.rss / 2**20,
                "rx_kbps": (h1.eth_rx_bytes - h0.eth_rx_bytes) / secs / 1024,
                "load_msgs": rate(m0, m1, "dynamo_router_load_reports_total", secs),
                "load_kbps": rate(m0, m1, "dynamo_router_load_report_bytes_total", secs) / 1024,
                "kv_msgs": rate(m0, m1, "dynamo_router_kv_event_batches_total", secs),
                "kv_kbps": rate(m0, m1, "dynamo_router_kv_event_bytes_total", secs) / 1024,
                "decision_p50_ms": _ms(quantile(m0, m1, "dynamo_router_decision_seconds", 0.5)),
                "decision_p99_ms": _ms(quantile(m0, m1, "dynamo_router_decision_seconds", 0.99)),
                "decision_cpu_p99_ms": _ms(quantile(m0, m1, "dynamo_router_decision_cpu_seconds",
                                                    0.99)),
                "decisions": rate(m0, m1, "dynamo_router_decisions_total", secs) * secs,
            })
        hosts = []
        for host in self.fleet.worker_hosts:
            if host.name in b["hosts"] and host.name in a["hosts"]:
                d = a["hosts"][host.name] - b["hosts"][host.name]
                hosts.append({
                    "mdns_in_pps": d.mcast_in_pkts / secs, "mdns_out_pps": d.mcast_out_pkts / secs,
                    "mdns_in_kbps": d.mcast_in_bytes / secs / 1024,
                    "mdns_out_kbps": d.mcast_out_bytes / secs / 1024,
                    "udp_pps": (d.udp_in + d.udp_out) / secs, "udp_drops": d.udp_rcvbuf_errors,
                })
        return {"seconds": secs, "frontends": fronts, "hosts": hosts,
                "workers_cpu_pct": 100 * (a["wcpu"] - b["wcpu"]) / secs}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


# -- load ------------------------------------------------------------------------------------


def _specs(fleet: Fleet, concurrency: int, duration: float, start_at: float) -> list[LoadSpec]:
    prompts = make_prompts(256, 8, 32, seed=1)
    n = len(fleet.frontend_hosts)
    return [LoadSpec(url=f"http://127.0.0.1:{HTTP_PORT}", model=MODEL, prompts=prompts,
                     concurrency=max(1, concurrency // n), duration=duration, start_at=start_at,
                     deadline=60.0, margin=15.0, max_requests=200_000, offset=i, stride=n)
            for i in range(n)]


async def _with_load(
    fleet: Fleet, concurrency: int, duration: float,
    during: Callable[[float], Any] | None = None,
) -> tuple[list[LoadResult], Any]:
    """Run load on every frontend for ``duration`` seconds; ``during(start_at)`` runs beside
    it (a coroutine function). Returns the load results and what ``during`` returned."""
    start_at = time.monotonic() + LOAD_DELAY
    specs = _specs(fleet, concurrency, duration, start_at)
    loads = asyncio.gather(*(asyncio.to_thread(run_load, h, s)
                             for h, s in zip(fleet.frontend_hosts, specs, strict=True)))
    extra = during(start_at) if during is not None else None
    if extra is not None:
        results, value = await asyncio.gather(loads, extra)
    else:
        results, value = await loads, None
    return list(results), value


def _lost(results: Sequence[LoadResult]) -> tuple[int, int]:
    """(requests ended well, requests failed or hung)."""
    ok = bad = 0
    for res in results:
        for rec in res.records:
            if rec.status == "ok":
                ok += 1
            else:
                bad += 1
    return ok, bad


# -- phases ----------------------------------------------------------------------------------


async def phase_cold(fleet: Fleet) -> dict[str, Any]:
    """Frontends first, then every worker process at once (see the module)."""
    fleet.start_frontends()
    t0 = time.monotonic()
    procs = await fleet.start_workers()
    all_ready = max(wp.ready_at for wp in procs) - t0
    waited = time.monotonic() - t0
    after = max(await fleet.wait_listed(fleet.live_ids(), timeout=600))
    listed = waited + after
    log(f"cold: {len(procs)} processes, all READY {all_ready:.1f}s, all listed {listed:.1f}s")
    return {"processes": len(procs), "all_ready_s": all_ready, "listed_s": listed,
            "listed_after_ready_s": listed - all_ready, **await _join(fleet)}


async def _join(fleet: Fleet) -> dict[str, Any]:
    """Restart the first frontend into the running fleet: seconds until it serves HTTP and
    until it lists every worker."""
    fleet.frontends[0].stop()
    host = fleet.frontend_hosts[0]
    t0 = time.monotonic()
    fleet.frontends[0] = fleet.start_frontend(host)
    serving = time.monotonic() - t0
    expect = fleet.live_ids()
    while not expect <= await asyncio.to_thread(instances, host, MODEL):
        if time.monotonic() - t0 > 600:
            raise TimeoutError("a restarted frontend did not list every worker in 600s")
        await asyncio.sleep(0.1)
    took = time.monotonic() - t0
    log(f"join: HTTP up after {serving:.1f}s, all listed after {took:.1f}s")
    return {"join_s": took, "join_http_s": serving}


async def phase_idle(fleet: Fleet, seconds: float) -> dict[str, Any]:
    await asyncio.sleep(10.0)  # the join's own traffic settles
    window = Window(fleet)
    window.start()
    await asyncio.sleep(seconds)
    return window.stop()


async def phase_load(fleet: Fleet, seconds: float, concurrency: int) -> dict[str, Any]:
    window = Window(fleet)

    async def measure(start_at: float) -> dict[str, Any]:
        await asyncio.sleep(max(0.0, start_at - time.monotonic() + 1.0))
        window.start()
        await asyncio.sleep(max(1.0, seconds - 2.0))
        return window.stop()

    results, figures = await _with_load(fleet, concurrency, seconds, measure)
    ok, lost = _lost(results)
    return {**figures, "requests": ok, "lost": lost}


def _victims(fleet: Fleet, share: float, rng: random.Random) -> list[WorkerProcess]:
    """Whole worker processes holding at least ``share`` of the live workers."""
    alive = [wp for wp in fleet.processes if wp.alive]
    rng.shuffle(alive)
    goal = math.ceil(share * sum(wp.count for wp in alive))
    chosen: list[WorkerProcess] = []
    for wp in sorted(alive, key=lambda w: w.count):
        if sum(w.count for w in chosen) >= goal:
            break
        chosen.append(wp)
    return chosen


async def phase_decide(fleet: Fleet, requests: int) -> dict[str, Any]:
    """Routing decision time on a machine that is not saturated: one request at a time, on
    one frontend at a time (under load this 2-core machine runs every process of the fleet
    and the load generators, and a decision's wall time is mostly waiting for a core)."""
    name, cpu_name = "dynamo_router_decision_seconds", "dynamo_router_decision_cpu_seconds"
    p50s, p99s, cpu99s, ok_all, lost_all = [], [], [], 0, 0
    prompts = make_prompts(max(1, requests), 8, 32, seed=2)
    for host in fleet.frontend_hosts:
        before = parse_metrics(get(host, "/metrics")[1])
        spec = LoadSpec(url=f"http://127.0.0.1:{HTTP_PORT}", model=MODEL, prompts=prompts,
                        concurrency=1, duration=0.0, start_at=time.monotonic() + LOAD_DELAY)
        result = await asyncio.to_thread(run_load, host, spec)
        after = parse_metrics(get(host, "/metrics")[1])
        p50s.append(_ms(quantile(before, after, name, 0.5)))
        p99s.append(_ms(quantile(before, after, name, 0.99)))
        cpu99s.append(_ms(quantile(before, after, cpu_name, 0.99)))
        ok, lost = _lost([result])
        ok_all, lost_all = ok_all + ok, lost_all + lost
    return {"requests": ok_all, "lost": lost_all, "decision_p50_ms": _max(p50s),
            "decision_p99_ms": _max(p99s), "decision_cpu_p99_ms": _max(cpu99s),
            "each_p50_ms": p50s, "each_p99_ms": p99s, "each_cpu_p99_ms": cpu99s}


def _down_times(fleet: Fleet, gone: set[int], since: float) -> list[float]:
    """Seconds from ``since`` (wall clock) to each frontend's log line marking the last of
    ``gone`` down (``peer ... instance=ID ... down``); inf where one is missing."""
    took = []
    for proc in fleet.frontends:
        text = Path(proc.log.name).read_text(errors="replace")
        at: dict[int, float] = {}
        for m in _DOWN.finditer(text):
            iid = int(m.group(2), 16)
            when = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if iid in gone and when >= since - 1.0:
                at.setdefault(iid, when)
        took.append(max(at.values()) - since if len(at) == len(gone) else math.inf)
    return took


_DOWN = re.compile(r"^(\S+ \S+) INFO \S+: peer PeerConnection\([^,]+, instance=([0-9a-f]+), "
                   r"\w+\) down", re.M)


async def phase_kill(fleet: Fleet, seconds: float, concurrency: int) -> dict[str, Any]:
    rng = random.Random(7)

    async def kill(start_at: float) -> dict[str, Any]:
        await asyncio.sleep(max(0.0, start_at - time.monotonic() + seconds / 3))
        victims = _victims(fleet, 0.10, rng)
        gone = {i for wp in victims for i in wp.ids}
        since = time.time()
        for wp in victims:
            assert wp.proc is not None
            wp.proc.signal(signal.SIGKILL)  # all at once; reaped below
        seen = await fleet.wait_unlisted(gone, timeout=60)
        for wp in victims:
            wp.kill()
        down = _down_times(fleet, gone, since)
        log(f"kill: {len(gone)} workers ({len(victims)} processes): down at every frontend "
            f"after {max(down):.3f}s (logs), gone from every /health after {max(seen):.2f}s")
        return {"killed": len(gone), "killed_processes": len(victims),
                "down_s": max(down), "down_each_s": down,
                "unlisted_s": max(seen), "unlisted_each_s": seen}

    results, figures = await _with_load(fleet, concurrency, seconds, kill)
    ok, lost = _lost(results)
    return {**figures, "requests": ok, "lost": lost}


async def phase_churn(fleet: Fleet, seconds: float, concurrency: int) -> dict[str, Any]:
    rng = random.Random(11)
    events: list[str] = []
    joining: list[asyncio.Future[None]] = []

    async def churn(start_at: float) -> None:
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        joined: list[WorkerProcess] = []
        leaves = 0
        for n in range(int(seconds)):
            await asyncio.sleep(max(0.0, start_at + n - time.monotonic()))
            ready = [wp for wp in joined if wp.ids]
            if n % 2 == 0 or not ready:
                host = fleet.worker_hosts[n % len(fleet.worker_hosts)]
                wp = WorkerProcess(host, fleet.worker_argv(1), 1)
                wp.spawn()
                fleet.processes.append(wp)
                joined.append(wp)
                joining.append(asyncio.ensure_future(asyncio.to_thread(wp.wait_ready, 120.0)))
                events.append("join")
                continue
            wp = ready[rng.randrange(len(ready))]
            joined.remove(wp)
            leaves += 1
            if leaves % 4 == 0:
                await asyncio.to_thread(wp.kill)
                events.append("kill")
            else:
                joining.append(asyncio.ensure_future(asyncio.to_thread(wp.stop, 30.0)))
                events.append("leave")

    results, _ = await _with_load(fleet, concurrency, seconds, churn)
    await asyncio.gather(*joining)  # every join READY, every leave exited
    ok, lost = _lost(results)
    await asyncio.sleep(5.0)
    stale, missing = await _status_check(fleet)
    log(f"churn: {events.count('join')} joins, {events.count('leave')} leaves, "
        f"{events.count('kill')} kills; lost {lost}; status: {len(stale)} stale, "
        f"{len(missing)} missing")
    return {"joins": events.count("join"), "leaves": events.count("leave"),
            "kills": events.count("kill"), "requests": ok, "lost": lost,
            "stale": len(stale), "missing": len(missing)}


async def _status_check(fleet: Fleet) -> tuple[set[int], set[int]]:
    """``python -m dynamo_zmq.status --json`` on a frontend host: instances it lists as
    serving that are gone, and live workers it does not list."""
    host = fleet.frontend_hosts[0]
    done = await asyncio.to_thread(
        host.run, [sys.executable, "-m", "dynamo_zmq.status", "--namespace",
                   fleet.cfg.namespace, "--json"], timeout=120)
    rows = json.loads(done.stdout)
    serving = {int(r["instance_id"], 16) for r in rows
               if r.get("component") == "backend" and r.get("state") in ("ready", "draining")}
    live = fleet.live_ids()
    return serving - live, live - serving


# -- a run and the tables ----------------------------------------------------------------------


async def run_one(cfg: FleetConfig, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"workers": cfg.workers, "frontends": cfg.frontends,
                           "hosts": cfg.hosts, "per_process": cfg.per_process()}
    with Fleet(cfg) as fleet:
        out["cold"] = await phase_cold(fleet)
        if "idle" in args.phases:
            out["idle"] = await phase_idle(fleet, args.idle)
        if "load" in args.phases:
            out["load"] = await phase_load(fleet, args.load, args.concurrency)
        if "decide" in args.phases:
            out["decide"] = await phase_decide(fleet, args.decide)
        if "kill" in args.phases:
            out["kill"] = await phase_kill(fleet, args.load, args.concurrency)
        if "churn" in args.phases:
            out["churn"] = await phase_churn(fleet, args.churn, args.concurrency)
    return out


def _mean(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _max(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def steady_row(run: dict[str, Any], phase: str) -> list[str]:
    w = run[phase]
    fr, hosts = w["frontends"], w["hosts"]
    row = [str(run["workers"]), str(run["frontends"]),
           _f(_max([f["cpu_pct"] for f in fr])), _f(_max([f["rss_mb"] for f in fr]), 0),
           _f(_mean([f["rx_kbps"] for f in fr])),
           _f(_mean([f["load_msgs"] for f in fr]), 0), _f(_mean([f["load_kbps"] for f in fr])),
           _f(_mean([f["kv_msgs"] for f in fr]), 0), _f(_mean([f["kv_kbps"] for f in fr])),
           _f(_mean([h["mdns_in_pps"] for h in hosts])),
           _f(_mean([h["mdns_in_kbps"] for h in hosts]), 2),
           _f(_mean([h["mdns_out_pps"] for h in hosts]), 2),
           _f(w["workers_cpu_pct"] / max(1, run["workers"]), 2)]
    if phase == "load":
        row += [_f(_max([f["decision_p50_ms"] for f in fr]), 3),
                _f(_max([f["decision_p99_ms"] for f in fr]), 3),
                _f(_max([f.get("decision_cpu_p99_ms") for f in fr]), 3), str(w["lost"])]
    return row


STEADY_HEAD = ["W", "F", "fe cpu%", "fe MB", "fe rx KB/s", "load msg/s", "load KB/s",
               "kv msg/s", "kv KB/s", "mdns in pkt/s/host", "mdns in KB/s/host",
               "mdns out pkt/s/host", "worker cpu%/worker"]


def table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = [" | ".join(h.rjust(widths[i]) for i, h in enumerate(head)),
             "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(c.rjust(widths[i]) for i, c in enumerate(r)) for r in rows]
    return "\n".join(lines)


def report(runs: list[dict[str, Any]]) -> str:
    parts = []
    rows = [[str(r["workers"]), str(r["frontends"]), str(r["cold"]["processes"]),
             _f(r["cold"]["all_ready_s"]), _f(r["cold"]["listed_s"]),
             _f(r["cold"]["listed_after_ready_s"]), _f(r["cold"]["join_http_s"]),
             _f(r["cold"]["join_s"])] for r in runs]
    parts.append("cold start (seconds)\n" + table(
        ["W", "F", "processes", "all READY", "all listed", "listed after READY",
         "join: HTTP up", "join: all listed"], rows))
    for phase in ("idle", "load"):
        rows = [steady_row(r, phase) for r in runs if phase in r]
        if rows:
            head = STEADY_HEAD + (["p50 ms", "p99 ms", "cpu p99 ms", "lost"]
                                  if phase == "load" else [])
            parts.append(f"{phase} (per frontend: max cpu and RSS, mean of the rest; "
                         f"per worker host: mean)\n" + table(head, rows))
    rows = [[str(r["workers"]), str(r["frontends"]), str(r["decide"]["requests"]),
             _f(r["decide"]["decision_p50_ms"], 3), _f(r["decide"]["decision_p99_ms"], 3),
             _f(r["decide"].get("decision_cpu_p99_ms"), 3)] for r in runs if "decide" in r]
    if rows:
        parts.append("routing decision time, one request at a time on one frontend at a time "
                     "(ms, the slowest frontend; cpu: the decision's own CPU time)\n"
                     + table(["W", "F", "requests", "p50", "p99", "cpu p99"], rows))
    rows = [[str(r["workers"]), str(r["frontends"]), str(r["kill"]["killed"]),
             _f(r["kill"]["down_s"], 3), _f(r["kill"]["unlisted_s"], 2),
             str(r["kill"]["requests"]), str(r["kill"]["lost"])] for r in runs if "kill" in r]
    if rows:
        parts.append("10% SIGKILLed at once under load (seconds until the last is out, at the "
                     "slowest frontend)\n" + table(
                         ["W", "F", "killed", "down (frontend logs)", "gone from /health",
                          "requests", "lost"], rows))
    rows = [[str(r["workers"]), str(r["frontends"]), str(r["churn"]["joins"]),
             str(r["churn"]["leaves"]), str(r["churn"]["kills"]), str(r["churn"]["requests"]),
             str(r["churn"]["lost"]), str(r["churn"]["stale"]), str(r["churn"]["missing"])]
            for r in runs if "churn" in r]
    if rows:
        parts.append("churn under load\n" + table(
            ["W", "F", "joins", "leaves", "kills", "requests", "lost", "stale", "missing"],
            rows))
    return "\n\n".join(parts)


def plot(runs: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("frontend CPU, % of a core", lambda w: _max([f["cpu_pct"] for f in w["frontends"]])),
        ("frontend RSS, MB", lambda w: _max([f["rss_mb"] for f in w["frontends"]])),
        ("bytes in at a frontend host, KB/s", lambda w: _mean([f["rx_kbps"]
                                                               for f in w["frontends"]])),
        ("load reports at a frontend, msg/s", lambda w: _mean([f["load_msgs"]
                                                               for f in w["frontends"]])),
        ("mDNS in per worker host, pkt/s", lambda w: _mean([h["mdns_in_pps"]
                                                            for h in w["hosts"]])),
        ("mDNS in per worker host, KB/s", lambda w: _mean([h["mdns_in_kbps"]
                                                           for h in w["hosts"]])),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (title, pick) in zip(axes.flat, panels, strict=True):
        for phase, style in (("idle", "-"), ("load", "--")):
            for fcount in sorted({r["frontends"] for r in runs}):
                pts = [(r["workers"], pick(r[phase])) for r in runs
                       if r["frontends"] == fcount and phase in r]
                pts = [(x, y) for x, y in pts if y is not None]
                if pts:
                    ax.plot(*zip(*pts, strict=True), style, marker="o",
                            label=f"{phase}, {fcount} frontend{'s' * (fcount > 1)}")
        ax.set_title(title)
        ax.set_xlabel("workers")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="8,32,128,256", help="worker counts W")
    p.add_argument("--frontends", default="1,4", help="frontend counts F")
    p.add_argument("--hosts", type=int, default=8, help="worker hosts")
    p.add_argument("--max-processes", type=int, default=64)
    p.add_argument("--workers-per-process", type=int, default=0, help="0: from --max-processes")
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--idle", type=float, default=20.0, help="idle window, seconds")
    p.add_argument("--load", type=float, default=20.0, help="load and kill runs, seconds")
    p.add_argument("--churn", type=float, default=60.0, help="churn run, seconds")
    p.add_argument("--decide", type=int, default=200,
                   help="requests of the decision probe on each frontend (one at a time)")
    p.add_argument("--concurrency", type=int, default=32, help="streams in flight, all frontends")
    p.add_argument("--speedup", type=float, default=10.0, help="the mocker's --speedup-ratio")
    p.add_argument("--worker-args", default="", help="extra worker flags")
    p.add_argument("--frontend-args", default="", help="extra frontend flags")
    p.add_argument("--plot", help="save the curves to this PNG")
    p.add_argument("--json", help="save every figure to this file")
    args = p.parse_args()
    args.phases = [x for x in args.phases.split(",") if x]
    why = cluster_supported()
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    runs = []
    defaults = FleetConfig()
    for fcount in (int(x) for x in args.frontends.split(",")):
        for size in (int(x) for x in args.sizes.split(",")):
            cfg = FleetConfig(
                hosts=args.hosts, workers=size, frontends=fcount,
                workers_per_process=args.workers_per_process, max_processes=args.max_processes,
                speedup=args.speedup, worker_args=shlex.split(args.worker_args),
                frontend_args=[*defaults.frontend_args, *shlex.split(args.frontend_args)],
                log=log,
            )
            log(f"fleet of {size} workers ({cfg.per_process()} a process) on {args.hosts} "
                f"hosts, {fcount} frontend(s)")
            runs.append(asyncio.run(run_one(cfg, args)))
            if args.json:
                Path(args.json).write_text(json.dumps(runs, indent=1))
    print(report(runs))
    if args.plot:
        plot(runs, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
