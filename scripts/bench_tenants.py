"""Serving many tenants: per-tenant limits (and, with ``--scenario lora``, LoRA routing).

    python scripts/bench_tenants.py [--scenario tenants|lora|all] [--duration 15]
        [--rate-b 4] [--limit-a 2] [--flood 5] [--max-tokens 32] [--prompt-words 60]
        [--workers 1] [--mocker-speedup 1] [--max-num-seqs 8] [--warmup 5] [--max-requests 2000]
        [--request-timeout 30] [--json OUT] [--plot OUT.png] [LORA ARGS...]

Scenario ``tenants``: one frontend with ``--tenant-limits`` and ``--workers`` mocker workers,
all on loopback, started and stopped (by pid) here. Tenant ``a`` may send ``--limit-a``
requests a second (burst the same), tenant ``b`` is not limited; requests name their tenant in
``x-dynamo-tenant``. Three phases of ``--duration`` seconds each, open loop, streaming
completions (``max_tokens`` = ``min_tokens`` = ``--max-tokens``, ``ignore_eos``), on a fresh
connection each:

1. ``alone``: tenant b at ``--rate-b`` requests a second;
2. ``flood``: tenant b on the same schedule while tenant a sends ``--flood`` times its limit;
3. ``unlimited``: the same, the flood sent as tenant c, which has no limit (what the limit
   spares b from).

Reported per phase and tenant: requests sent, ok, refused with 429, other failures, TTFT p50 and
p99 of the ok ones, and the frontend's CPU seconds; then tenant b's TTFT p99 with the flood over
its p99 alone (the goal: at most 1.2) and the same without the limit, and tenant a's 429s.
Arrivals are evenly spaced with a seeded jitter, at most ``--max-requests`` per tenant and
phase. ``--plot`` draws b's TTFT CDF in each phase (needs matplotlib); ``--json`` writes the
rows.

Scenario ``lora`` runs ``scripts/bench_lora_routing.py``'s ``main(argv)`` with the arguments
this script does not know (``all``: both, tenants first).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_e2e as be
import bench_router_trace as rt

MODEL = "bench-tenants"
#: Requests of one tenant in flight at most (beyond, the schedule waits: bounded load).
MAX_INFLIGHT = 512


def limits_file(path: Path, args: argparse.Namespace) -> Path:
    rate = args.limit_a
    path.write_text(f"[tenants.a]\nrequests_per_second = {rate}\n"
                    f"burst = {max(1, math.ceil(rate))}\n\n[tenants.b]\n")
    return path


async def one(url: str, tenant: str, body: bytes, timeout: float) -> be.Result:
    """One streaming request of ``tenant``; its result (``error`` says why it failed)."""
    parts = be.urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nx-dynamo-tenant: {tenant}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    res = be.Result(ok=False, t_send=time.perf_counter())
    conn = be.Conn(host, port)
    try:
        await asyncio.wait_for(conn.stream(head, body, res), timeout)
    except Exception as exc:  # every failure is counted, by kind
        res.ok = False
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        conn.close()
    return res


async def send(url: str, tenant: str, rate: float, args: argparse.Namespace,
               bodies: list[bytes], seed: int) -> list[be.Result]:
    """``tenant``'s open-loop schedule: ``rate`` a second for ``--duration`` seconds."""
    rng = random.Random(seed)
    gap = 1.0 / rate
    count = min(args.max_requests, max(1, int(args.duration * rate)))
    sem = asyncio.Semaphore(MAX_INFLIGHT)
    tasks: list[asyncio.Task[be.Result]] = []

    async def bounded(body: bytes) -> be.Result:
        async with sem:
            return await one(url, tenant, body, args.request_timeout)

    start = time.perf_counter()
    for i in range(count):
        due = start + (i + rng.uniform(-0.3, 0.3)) * gap
        if (wait := due - time.perf_counter()) > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(bounded(bodies[i % len(bodies)])))
    return list(await asyncio.gather(*tasks))


def summary(phase: str, tenant: str, results: list[be.Result], cpu: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    refused = sum(1 for r in results if not r.ok and "HTTP 429" in (r.error or ""))
    ttft = [(r.t_first - r.t_send) * 1000 for r in ok if not math.isnan(r.t_first)]
    errors = sorted({r.error for r in results if not r.ok and "HTTP 429" not in (r.error or "")
                     and r.error})
    return {"phase": phase, "tenant": tenant, "sent": len(results), "ok": len(ok),
            "429": refused, "failed": len(results) - len(ok) - refused,
            "ttft_p50_ms": be.pct(ttft, 0.5), "ttft_p99_ms": be.pct(ttft, 0.99),
            "ttft_ms": ttft, "frontend_cpu_s": cpu, "errors": errors[:3]}


def table(rows: list[dict[str, Any]]) -> str:
    cols = ["phase", "tenant", "sent", "ok", "429", "failed", "TTFT p50 ms", "TTFT p99 ms",
            "frontend CPU s"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join([
            r["phase"], r["tenant"], str(r["sent"]), str(r["ok"]), str(r["429"]),
            str(r["failed"]), rt.fmt(r["ttft_p50_ms"]), rt.fmt(r["ttft_p99_ms"]),
            rt.fmt(r["frontend_cpu_s"], 2),
        ]) + " |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        if r["tenant"] != "b" or not r["ttft_ms"]:
            continue
        values = sorted(r["ttft_ms"])
        ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post",
                label=f"tenant b, {r['phase']}")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Tenant b's TTFT: alone, a flooding (limited), c flooding (not)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def tenants_scenario(args: argparse.Namespace) -> dict[str, Any]:
    from dynamo_zmq.tools.tiny_model import build_tiny_model

    work = Path(os.environ.get("BENCH_LOGS", f"/tmp/bench_tenants-{os.getpid()}"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = build_tiny_model(work / "model")
    ns = f"btenants-{os.getpid()}-{int(time.time())}"
    procs = rt.Procs(work)
    rng = random.Random(0)
    words = be.PromptMaker(0, 1, 1, None, 1.0).words
    bodies = [json.dumps({
        "model": MODEL, "prompt": " ".join(rng.choice(words) for _ in range(args.prompt_words)),
        "max_tokens": args.max_tokens, "min_tokens": args.max_tokens, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }).encode() for _ in range(64)]
    rows: list[dict[str, Any]] = []
    try:
        for i in range(args.workers):
            procs.start(f"worker{i}", [
                "-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path", str(model_dir),
                "--model-name", MODEL, "--namespace", ns, "--host", "127.0.0.1",
                "--speedup-ratio", str(args.mocker_speedup),
                "--max-num-seqs", str(args.max_num_seqs)], timeout=60)
        line = procs.start("frontend", [
            "-m", "dynamo_zmq.frontend", "--http-host", "127.0.0.1", "--http-port", "0",
            "--namespace", ns, "--tenant-limits", str(limits_file(work / "limits.toml", args)),
        ], timeout=60)
        url = line.split()[1]
        rt.wait_listed(url, MODEL)
        front = psutil.Process(procs.procs[-1].pid)

        async def phases() -> None:
            for i in range(args.warmup):
                await one(url, "b", bodies[i % len(bodies)], args.request_timeout)
            cpu0 = _cpu(front)
            alone = await send(url, "b", args.rate_b, args, bodies, seed=1)
            cpu1 = _cpu(front)
            rows.append(summary("alone", "b", alone, cpu1 - cpu0))
            await asyncio.sleep(1.0 / args.limit_a)  # a's bucket is full again (unused yet)
            cpu1 = _cpu(front)
            flood_b, flood_a = await asyncio.gather(
                send(url, "b", args.rate_b, args, bodies, seed=1),
                send(url, "a", args.flood * args.limit_a, args, bodies, seed=2),
            )
            cpu2 = _cpu(front)
            rows.append(summary("flood", "b", flood_b, cpu2 - cpu1))
            rows.append(summary("flood", "a", flood_a, cpu2 - cpu1))
            free_b, free_c = await asyncio.gather(
                send(url, "b", args.rate_b, args, bodies, seed=1),
                send(url, "c", args.flood * args.limit_a, args, bodies, seed=2),
            )
            cpu3 = _cpu(front)
            rows.append(summary("unlimited", "b", free_b, cpu3 - cpu2))
            rows.append(summary("unlimited", "c", free_c, cpu3 - cpu2))

        asyncio.run(phases())
        page = rt.http_get(url + "/metrics").decode()
    finally:
        procs.stop()
    b_alone, b_flood, a_flood, b_free, _ = rows

    def ratio(r: dict[str, Any]) -> float:
        return r["ttft_p99_ms"] / b_alone["ttft_p99_ms"] if b_alone["ttft_p99_ms"] else math.nan

    return {"rows": rows, "ratio": ratio(b_flood), "ratio_unlimited": ratio(b_free),
            "a_429": a_flood["429"],
            "a_rejections_metric": rt.metric_sum(page, "dynamo_frontend_tenant_rejections"),
            "logs": str(work)}


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def lora_scenario(argv: list[str]) -> int:
    """``scripts/bench_lora_routing.py``'s ``main(argv)``."""
    if not (Path(__file__).resolve().parent / "bench_lora_routing.py").exists():
        print("error: scenario lora: bench_lora_routing.py not present", file=sys.stderr)
        return 2
    module = importlib.import_module("bench_lora_routing")
    return int(module.main(argv) or 0)


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=["tenants", "lora", "all"], default="tenants")
    p.add_argument("--duration", type=float, default=15.0, help="seconds per phase")
    p.add_argument("--rate-b", type=float, default=4.0, help="tenant b's requests a second")
    p.add_argument("--limit-a", type=float, default=2.0, help="tenant a's requests_per_second")
    p.add_argument("--flood", type=float, default=5.0, help="tenant a sends this x its limit")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=60)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--mocker-speedup", type=float, default=1.0)
    p.add_argument("--max-num-seqs", type=int, default=8,
                   help="the mocker's batch (beyond it requests queue: a flood can hurt)")
    p.add_argument("--warmup", type=int, default=5, help="unmeasured requests of b first")
    p.add_argument("--max-requests", type=int, default=2000,
                   help="most requests per tenant and phase")
    p.add_argument("--request-timeout", type=float, default=30.0)
    p.add_argument("--json", metavar="OUT")
    p.add_argument("--plot", metavar="OUT")
    args, rest = p.parse_known_args(argv)
    if min(args.duration, args.rate_b, args.limit_a, args.flood) <= 0 or args.workers < 1:
        p.error("--duration, --rate-b, --limit-a, --flood and --workers must be positive")
    if rest and args.scenario == "tenants":
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    return args, rest


def main(argv: list[str] | None = None) -> int:
    args, rest = parse(argv)
    rc = 0
    if args.scenario in ("tenants", "all"):
        res = tenants_scenario(args)
        print(f"tenant a: limit {args.limit_a:g} req/s, sends {args.flood:g}x (c: the same, no "
              f"limit); tenant b: {args.rate_b:g} req/s, no limit; {args.workers} mocker "
              f"worker(s), speedup {args.mocker_speedup:g}, {args.max_tokens} tokens out, "
              f"{args.duration:g} s per phase")
        print(table(res["rows"]))
        print(f"\ntenant b TTFT p99, flood / alone: {rt.fmt(res['ratio'], 2)} (goal <= 1.2; "
              f"without the limit: {rt.fmt(res['ratio_unlimited'], 2)}); "
              f"tenant a refused with 429: {res['a_429']} (frontend metric: "
              f"{rt.fmt(res['a_rejections_metric'], 0)})")
        for r in res["rows"]:
            for error in r["errors"]:
                print(f"{r['phase']} {r['tenant']} failed: {error}")
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
        if args.plot:
            plot(res["rows"], args.plot)
            print(f"plot written to {args.plot}")
    if args.scenario in ("lora", "all"):
        rc = lora_scenario(rest)
    return rc


if __name__ == "__main__":
    sys.exit(main())
