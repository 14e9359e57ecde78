#!/usr/bin/env python3
"""A chaos run that must lose nothing (issue 14 item 6). Needs root (network namespaces).

    python scripts/chaos.py [--worker-hosts 4] [--workers-per-host 2] [--frontends 1]
        [--concurrency 64] [--duration 60] [--fault-interval 5] [--faults kill,stop,cut,term]
        [--seed 0] [--speedup 0.5] [--no-baseline] [--plot FILE.png] [--json FILE]

Builds hosts as network namespaces (``dynamo_zmq.tools.netns``): frontend hosts and worker
hosts with mocker workers, found by mDNS. Records a fault-free reference of a seeded prompt pool,
runs streaming load (the ``openai`` client, inside the frontends' hosts) fault-free and then
with one fault every interval (SIGKILL + restart, SIGSTOP + SIGCONT, link cut + heal, SIGTERM +
restart) on worker hosts only, checks every request against the reference and prints a table
side by side. Exit status 1 if any request failed, hung or was wrong (or the reference was not
clean), so CI can use it. See docs/benchmarks.md, "Chaos".
"""

from __future__ import annotations

import argparse
import sys
import time

import msgspec

from dynamo_zmq.tools.chaos import ChaosConfig, run_chaos
from dynamo_zmq.tools.chaos_faults import FAULT_KINDS
from dynamo_zmq.tools.chaos_report import format_table, plot, reference_problems, stats
from dynamo_zmq.tools.netns import cluster_supported


def main() -> int:
    d = ChaosConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker-hosts", type=int, default=d.worker_hosts)
    p.add_argument("--workers-per-host", type=int, default=d.workers_per_host)
    p.add_argument("--frontends", type=int, choices=(1, 2), default=d.frontends,
                   help="frontend hosts (load is split between them)")
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--duration", type=float, default=d.duration, help="seconds per run")
    p.add_argument("--fault-interval", type=float, default=d.fault_interval)
    p.add_argument("--faults", default=",".join(FAULT_KINDS),
                   help="fault kinds, cycled in this order")
    p.add_argument("--seed", type=int, default=d.seed, help="prompt pool and fault targets")
    p.add_argument("--speedup", type=float, default=d.speedup,
                   help="the mocker's --speedup-ratio (lower: slower tokens)")
    p.add_argument("--pool", type=int, default=d.pool, help="distinct prompts")
    p.add_argument("--min-tokens", type=int, default=d.min_tokens)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--request-timeout", type=float, default=d.request_timeout,
                   help="each request's deadline (frontend --request-timeout and header)")
    p.add_argument("--max-requests", type=int, default=d.max_requests,
                   help="a bound on requests per run")
    p.add_argument("--down-for", type=float, default=d.down_for,
                   help="seconds a worker stays stopped / a link stays cut")
    p.add_argument("--restart-after", type=float, default=d.restart_after,
                   help="seconds before a killed worker starts again")
    p.add_argument("--graceful-timeout", type=float, default=d.graceful_timeout,
                   help="the workers' --graceful-timeout (SIGTERM)")
    p.add_argument("--no-baseline", action="store_true", help="skip the fault-free run")
    p.add_argument("--model-path", help="model directory (default: a tiny model built here)")
    p.add_argument("--plot", metavar="FILE.png", help="throughput over time, faults marked")
    p.add_argument("--json", metavar="FILE", help="save the raw results")
    p.add_argument("--logs", action="store_true", help="print the processes' logs at the end")
    p.add_argument("--logs-dir", metavar="DIR", help="save every process's whole log here")
    args = p.parse_args()
    why = cluster_supported()
    if why:
        print(f"chaos: {why}", file=sys.stderr)
        return 2
    kinds = tuple(k for k in args.faults.split(",") if k)
    if bad := [k for k in kinds if k not in FAULT_KINDS]:
        p.error(f"unknown fault kinds {bad} (known: {', '.join(FAULT_KINDS)})")
    t0 = time.monotonic()
    cfg = ChaosConfig(
        worker_hosts=args.worker_hosts, workers_per_host=args.workers_per_host,
        frontends=args.frontends, concurrency=args.concurrency, duration=args.duration,
        fault_interval=args.fault_interval, faults=kinds, seed=args.seed, speedup=args.speedup,
        pool=args.pool, min_tokens=args.min_tokens, max_tokens=args.max_tokens,
        request_timeout=args.request_timeout, max_requests=args.max_requests,
        down_for=args.down_for, restart_after=args.restart_after,
        graceful_timeout=args.graceful_timeout, baseline=not args.no_baseline,
        model_path=args.model_path, logs_dir=args.logs_dir,
        log=lambda msg: print(f"[{time.monotonic() - t0:6.1f}s] {msg}", file=sys.stderr),
    )
    result = run_chaos(cfg)
    bad_reference = reference_problems(result)
    runs = [stats(result, run) for run in result.runs]
    print(format_table(runs))
    chaos = result.runs[-1]
    print("\nfaults (seconds from the chaos run's start):")
    for f in chaos.faults:
        back = f"back at {f.recovered - chaos.start:.1f}" if f.recovered else "NOT undone"
        print(f"  {f.start - chaos.start:5.1f} {f.kind:4} {f.target:8} {back} {f.note}")
    for s in runs:
        for prob in s.problems[:20]:
            print(f"{s.name}: {prob.status} request {prob.index} (prompt {prob.prompt}) after "
                  f"[{prob.fault}] worker {prob.worker}: {prob.error} tokens "
                  f"{prob.token_delta:+d} chunks {prob.chunk_delta:+d} "
                  f"first difference at char {prob.first_difference}")
    for line in bad_reference:
        print(f"reference: {line}")
    if args.logs:
        for name, text in result.worker_logs.items():
            print(f"\n===== {name} =====\n{text}")
    if args.json:
        with open(args.json, "wb") as f:
            f.write(msgspec.json.encode({"result": result, "stats": runs}))
    if args.plot:
        plot(result, runs, args.plot)
    failed = bad_reference or any(s.failed or s.hung or s.wrong for s in runs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
