"""Adapter-aware KV routing vs round-robin on a LoRA trace, on mocker workers.

    python scripts/bench_lora_routing.py [--workers 4] [--adapters 6] [--max-loras 3]
        [--lora-load-delay 0.2] [--system-prompts 1] [--system-blocks 16] [--user-tokens 96]
        [--tokens-per-block 64] [--num-gpu-blocks 160] [--max-output 16] [--rate 20]
        [--max-requests 240] [--max-seconds 60] [--prefill-ms-per-token 0.05]
        [--mocker-speedup 1] [--modes kv,round-robin]
        [--router-args "--kv-lora-miss-blocks 0"] [--seed 0] [--json OUT] [--plot OUT.png]

The trace: ``--adapters`` LoRA adapters, each with ``--system-prompts`` system prompts of
``--system-blocks`` full blocks shared by its requests, each request a system prompt of its
adapter plus ``--user-tokens`` random tokens; adapters are drawn with Zipf-like weights
(1/rank), arrivals are Poisson at ``--rate`` requests/s (open loop), every request asks for
``--max-output`` tokens. The same trace runs under each mode on a fresh set of processes:
``--workers`` mocker workers (``--enable-lora --max-loras N --lora-load-delay S``, a flat prefill
cost per uncached token so cache hits show in TTFT) and one frontend in that router mode; every
adapter is loaded on every worker through ``POST /v1/load_lora_adapter``. Round-robin spreads
each adapter over every worker (its system prompts cached everywhere, its adapter swapped in
and out of ``--max-loras`` slots); kv routing sends a request where its adapter's blocks are.

The kv frontend gets ``--router-args`` (default none: Dynamo's overlap weight 1 and the
router's default ``--kv-lora-miss-blocks``). The miss term is what makes kv routing win here:
with ``--router-args "--kv-lora-miss-blocks 0"`` the cost sees only blocks and load, so load
balancing sends an adapter's next request to an idle worker, which must first load the adapter
(and evict another), and the workers thrash their ``--max-loras`` slots.

Reported per mode: requests ok / failed, prefix hit rate (the mocker's cached prompt tokens /
prompt tokens), TTFT p50 / p99, adapter loads (the workers' ``mocker_lora_loads``); then kv's
ratios to round-robin. Processes are stopped by pid
when a mode ends. ``main(argv)`` runs it from another script (it returns the exit status; the
results are in ``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_disagg as bd  # a worker's metrics port
import bench_e2e as be  # its asyncio HTTP/SSE client
import bench_router_trace as rt  # processes, and the usage chunk's cached tokens

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dynamo_zmq.tools.lora_adapter import write_adapter_config

MODES = {"kv": "kv", "round-robin": "round-robin", "random": "random"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--workers", type=int, default=4)
    add("--adapters", type=int, default=6)
    add("--max-loras", type=int, default=3)
    add("--lora-load-delay", type=float, default=0.2, help="seconds (before --mocker-speedup)")
    add("--system-prompts", type=int, default=1, help="system prompts per adapter")
    add("--system-blocks", type=int, default=16, help="full blocks per system prompt")
    add("--user-tokens", type=int, default=96)
    add("--tokens-per-block", type=int, default=64)
    add("--max-output", type=int, default=16)
    add("--rate", type=float, default=20.0, help="requests per second (Poisson)")
    add("--max-requests", type=int, default=240)
    add("--max-seconds", type=float, default=60.0, help="bound on each mode's sending")
    add("--request-timeout", type=float, default=60.0)
    add("--max-inflight", type=int, default=256)
    add("--prefill-ms-per-token", type=float, default=0.05)
    add("--mocker-speedup", type=float, default=1.0)
    add("--num-gpu-blocks", type=int, default=160)
    add("--vocab-size", type=int, default=3000)
    add("--context-length", type=int, default=8192)
    add("--modes", default="kv,round-robin")
    add("--router-args", default="",
        help="more frontend flags in kv mode (default none: the router's defaults)")
    add("--seed", type=int, default=0)
    add("--settle", type=float, default=2.0, help="seconds for the frontend to find every worker")
    add("--workdir", default=os.path.join(tempfile.gettempdir(), "bench_lora_routing"))
    add("--json", help="write the results here")
    add("--plot", help="write a bar chart here (needs matplotlib)")
    return p


def make_trace(args: argparse.Namespace) -> list[tuple[float, str, list[int]]]:
    """(arrival seconds, adapter, prompt) per request."""
    rng = random.Random(args.seed)
    bs = args.tokens_per_block
    systems = {
        f"lora{a}": [[rng.randrange(10, args.vocab_size) for _ in range(args.system_blocks * bs)]
                     for _ in range(args.system_prompts)]
        for a in range(args.adapters)
    }
    names = sorted(systems)
    weights = [1 / (i + 1) for i in range(len(names))]
    t, out = 0.0, []
    for _ in range(args.max_requests):
        t += rng.expovariate(args.rate)
        name = rng.choices(names, weights)[0]
        prompt = rng.choice(systems[name]) + [
            rng.randrange(10, args.vocab_size) for _ in range(args.user_tokens)]
        out.append((t, name, prompt))
    return out


def post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:  # loopback only
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


async def replay(url: str, trace: list[tuple[float, str, list[int]]],
                 args: argparse.Namespace) -> list[tuple[be.Result, dict[str, Any]]]:
    """Send the trace open loop; each request's result and a box with its cached tokens."""
    u = urlsplit(url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    sem = asyncio.Semaphore(args.max_inflight)
    results: list[tuple[be.Result, dict[str, Any]]] = []

    async def one(model: str, prompt: list[int]) -> None:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": args.max_output,
                           "min_tokens": args.max_output, "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        res = be.Result(ok=False, t_send=time.perf_counter())
        box: dict[str, Any] = {"prompt_len": len(prompt)}
        rt._cached.set(box)
        results.append((res, box))
        async with sem:
            conn = be.Conn(host, port)
            try:
                await asyncio.wait_for(conn.stream(head, body, res), args.request_timeout)
            except Exception as exc:  # every failure is counted
                res.ok = False
                res.error = f"{type(exc).__name__}: {exc}"[:200]
            finally:
                conn.close()

    start = time.perf_counter()
    tasks = []
    for due, model, prompt in trace:
        now = time.perf_counter() - start
        if now > args.max_seconds:
            break
        if due > now:
            await asyncio.sleep(due - now)
        tasks.append(asyncio.create_task(one(model, prompt)))
    left = max(1.0, args.max_seconds + args.request_timeout - (time.perf_counter() - start))
    _done, pending = await asyncio.wait(tasks, timeout=left) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return results


def run_mode(mode: str, trace: list[tuple[float, str, list[int]]], args: argparse.Namespace,
             model_dir: Path, adapters: dict[str, Path], logroot: Path) -> dict[str, Any]:
    logdir = logroot / mode
    logdir.mkdir(parents=True, exist_ok=True)
    ns = f"blora-{mode}-{os.getpid()}-{int(time.time())}"
    procs = rt.Procs(logdir)
    metrics: list[str] = []
    try:
        for i in range(args.workers):
            procs.start(f"worker{i}", [
                "-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path", str(model_dir),
                "--model-name", "base", "--namespace", ns, "--host", "127.0.0.1",
                "--speedup-ratio", str(args.mocker_speedup),
                "--block-size", str(args.tokens_per_block),
                "--num-gpu-blocks-override", str(args.num_gpu_blocks),
                "--prefill-ms-per-token", str(args.prefill_ms_per_token),
                "--enable-lora", "--max-loras", str(args.max_loras),
                "--lora-load-delay", str(args.lora_load_delay), "--metrics-port", "0",
            ], timeout=60)
            metrics.append(bd.metrics_url(logdir / f"worker{i}.log"))
        line = procs.start("frontend", [
            "-m", "dynamo_zmq.frontend", "--http-host", "127.0.0.1", "--http-port", "0",
            "--namespace", ns, "--router-mode", MODES[mode],
            *(args.router_args.split() if mode == "kv" else ()),
        ], timeout=60)
        url = line.split()[1]
        rt.wait_listed(url, "base")
        time.sleep(args.settle)  # every worker discovered
        for name, path in adapters.items():
            status, body = post(f"{url}/v1/load_lora_adapter",
                                {"lora_name": name, "lora_path": str(path)})
            if status != 200:
                raise RuntimeError(f"loading {name}: {status} {body[:200]!r}")
        started = time.perf_counter()
        results = asyncio.run(replay(url, trace, args))
        wall = time.perf_counter() - started
        pages = [bd.scrape(u) for u in metrics]
        front = bd.scrape(url)
    finally:
        procs.stop()
    ok = [(r, box) for r, box in results if r.ok]
    ttft = [(r.t_first - r.t_send) * 1000 for r, _ in ok if not math.isnan(r.t_first)]
    prompt = sum(box["prompt_len"] for _, box in ok)
    cached = sum(box.get("cached", 0) for _, box in ok)
    errors = sorted({r.error or "?" for r, _ in results if not r.ok})
    return {
        "mode": mode, "sent": len(results), "ok": len(ok), "failed": len(results) - len(ok),
        "wall_s": wall, "hit_rate": cached / prompt if prompt else float("nan"),
        "ttft_p50_ms": be.pct(ttft, 0.5), "ttft_p99_ms": be.pct(ttft, 0.99),
        "adapter_loads": sum(rt.metric_sum(p, "mocker_lora_loads") or 0 for p in pages),
        "adapter_evictions": sum(rt.metric_sum(p, "mocker_lora_evictions") or 0 for p in pages),
        "router_matched_blocks": rt.metric_sum(front, "dynamo_router_matched_blocks"),
        "router_prompt_blocks": rt.metric_sum(front, "dynamo_router_prompt_blocks"),
        "errors": errors[:5],
    }


def fmt(x: float, nd: int = 1) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def table(res: list[dict[str, Any]]) -> str:
    lines = ["| mode | ok / failed | hit rate | TTFT p50 ms | TTFT p99 ms | adapter loads |",
             "|---|---|---|---|---|---|"]
    for r in res:
        lines.append(f"| {r['mode']} | {r['ok']} / {r['failed']} | {fmt(r['hit_rate'] * 100)}% "
                     f"| {fmt(r['ttft_p50_ms'])} | {fmt(r['ttft_p99_ms'])} "
                     f"| {r['adapter_loads']:.0f} |")
    by = {r["mode"]: r for r in res}
    if "kv" in by and "round-robin" in by:
        kv, rr = by["kv"], by["round-robin"]
        lines.append("")
        p50 = kv["ttft_p50_ms"] / rr["ttft_p50_ms"]
        p99 = kv["ttft_p99_ms"] / rr["ttft_p99_ms"]
        lines.append(
            f"kv vs round-robin: hit rate {fmt(kv['hit_rate'] * 100)}% vs "
            f"{fmt(rr['hit_rate'] * 100)}%; TTFT p50 x{fmt(p50, 2)}, p99 x{fmt(p99, 2)} "
            "(below 1: kv faster)")
    return "\n".join(lines)


def plot(res: list[dict[str, Any]], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    modes = [r["mode"] for r in res]
    axes[0].bar(modes, [r["hit_rate"] * 100 for r in res])
    axes[0].set_ylabel("prefix hit rate %")
    x = range(len(res))
    axes[1].bar([i - 0.2 for i in x], [r["ttft_p50_ms"] for r in res], 0.4, label="p50")
    axes[1].bar([i + 0.2 for i in x], [r["ttft_p99_ms"] for r in res], 0.4, label="p99")
    axes[1].set_xticks(list(x), modes)
    axes[1].set_ylabel("TTFT ms")
    axes[1].legend()
    fig.suptitle("LoRA trace: adapter-aware kv routing vs round-robin")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            print(f"unknown mode {m!r} (choose from {', '.join(MODES)})", file=sys.stderr)
            return 2
    work = Path(args.workdir)
    model_dir = rt.tiny_model(work, args)
    adapters = {f"lora{a}": write_adapter_config(work / "adapters" / f"lora{a}", 8, "base")
                for a in range(args.adapters)}
    trace = make_trace(args)
    logroot = work / f"logs-{int(time.time())}"
    res = []
    for mode in modes:
        print(f"-- {mode}: {len(trace)} requests, {args.workers} workers", flush=True)
        res.append(run_mode(mode, trace, args, model_dir, adapters, logroot))
        print(json.dumps(res[-1]), flush=True)
    print(table(res))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": res}, indent=2))
    if args.plot:
        plot(res, args.plot)
    return 0 if all(r["ok"] for r in res) else 1


if __name__ == "__main__":
    sys.exit(main())
