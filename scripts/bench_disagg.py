"""Aggregated vs disaggregated vs conditional serving, on the same number of mocker workers.

    python scripts/bench_disagg.py [--trace /work/shared/traces/mooncake_arxiv_trace_first20.jsonl]
        [--max-requests 60] [--max-seconds 90] [--speedup 1] [--workers 2]
        [--tokens-per-block 128] [--max-output 64] [--mocker-speedup 1]
        [--bandwidth 10] [--modes agg,disagg,conditional] [--json OUT] [--plot OUT.png]

Each mode replays the same requests (a Mooncake-format trace: long prompts, where prefill costs
matter; see ``bench_router_trace.py`` for how rows become token prompts) open loop against a
fresh set of processes: ``--workers`` mocker workers and one frontend, all on loopback.

- ``agg``: every worker aggregated (``--disaggregation-mode agg``), round-robin routing.
- ``disagg``: half the workers prefill, half decode; every request prefills remotely.
- ``conditional``: the same workers; a request prefills remotely only when its uncached part is
  longer than ``--max-local-prefill`` tokens and the prefill pool is not busy (the frontend's
  rule), else the decode worker prefills it.

``--engine vllm`` runs the same modes on vLLM workers (the tiny random model on this CPU, KV
moved by our KV connector); use small prompts (``--tokens-per-block 32``) and a context to
match (``--context-length 2048``).

Reported per mode: requests ok / failed, output tok/s, TTFT p50/p99, per-request mean ITL
p50/p99, remote and local prefills (the frontend's counters) and the KV moved between workers:
KV MB and transfer seconds (the mocker's: modeled from its KV size and bandwidth flags; vLLM's:
what its connector pulled, from the decode workers' logs) and wire MB (what the mocker's
transfer protocol really carried: each block's hash and token ids). Processes are stopped by
pid when a mode ends, and again on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_e2e as be
import bench_router_trace as rt

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = "/work/shared/traces/mooncake_arxiv_trace_first20.jsonl"


def roles(mode: str, workers: int) -> list[str]:
    """The disaggregation role of each worker in ``mode``."""
    if mode == "agg":
        return ["agg"] * workers
    prefill = max(1, workers // 2)
    return ["prefill"] * prefill + ["decode"] * max(1, workers - prefill)


def frontend_flags(mode: str, args: argparse.Namespace) -> list[str]:
    if mode == "agg":
        return []
    if mode == "disagg":
        return ["--disagg-mode", "always"]
    return ["--disagg-mode", "conditional",
            "--disagg-max-local-prefill-tokens", str(args.max_local_prefill),
            "--disagg-max-prefill-queue", str(args.max_prefill_queue)]


def metrics_url(log: Path, timeout: float = 10.0) -> str:
    """The worker's /metrics URL, from the port its log names."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(r"metrics and health on port (\d+)", log.read_text(errors="replace"))
        if found:
            return f"http://127.0.0.1:{found.group(1)}"
        time.sleep(0.1)
    raise RuntimeError(f"no metrics port in {log}")


def engine_flags(args: argparse.Namespace) -> list[str]:
    if args.engine == "vllm":  # the tiny model on this CPU, vLLM's block size (32)
        return ["--max-model-len", str(args.context_length), "--dtype", "float32",
                "--enforce-eager"]
    return ["--speedup-ratio", str(args.mocker_speedup),
            "--block-size", str(args.tokens_per_block),
            "--num-gpu-blocks-override", str(args.num_gpu_blocks),
            "--max-num-batched-tokens", str(args.max_batched_tokens),
            "--kv-transfer-bandwidth", str(args.bandwidth),
            "--kv-bytes-per-token", str(args.kv_bytes_per_token)]


def vllm_pulls(logdir: Path) -> tuple[float, float]:
    """Bytes and seconds of the KV pulls the vLLM decode workers' connectors logged."""
    nbytes = seconds = 0.0
    for log in logdir.glob("worker*-decode.log"):
        for b, t in re.findall(r"pulled \d+ blocks \((\d+) bytes\) .* in ([\d.]+) s",
                               log.read_text(errors="replace")):
            nbytes += int(b)
            seconds += float(t)
    return nbytes, seconds


def scrape(url: str) -> str:
    try:
        return rt.http_get(url + "/metrics").decode()
    except OSError:
        return ""


def run_mode(mode: str, rows: list[dict], prompts: list[list[int]], args: argparse.Namespace,
             model_dir: Path, logroot: Path) -> dict[str, Any]:
    logdir = logroot / mode
    logdir.mkdir(parents=True, exist_ok=True)
    ns = f"bdisagg-{mode}-{os.getpid()}-{int(time.time())}"
    procs = rt.Procs(logdir)
    metrics_urls: list[str] = []  # the workers' system ports
    try:
        for i, role in enumerate(roles(mode, args.workers)):
            procs.start(f"worker{i}-{role}", [
                "-m", "dynamo_zmq.worker", "--engine", args.engine,
                "--model-path", str(model_dir), "--model-name", args.model_name,
                "--namespace", ns, "--host", "127.0.0.1", "--disaggregation-mode", role,
                "--metrics-port", "0", *engine_flags(args),
            ], timeout=300 if args.engine == "vllm" else 60)
            metrics_urls.append(metrics_url(logdir / f"worker{i}-{role}.log"))
        line = procs.start("frontend", [
            "-m", "dynamo_zmq.frontend", "--http-host", "127.0.0.1", "--http-port", "0",
            "--namespace", ns, *frontend_flags(mode, args),
        ], timeout=60)
        url = line.split()[1]
        rt.wait_listed(url, args.model_name)
        time.sleep(args.settle)  # every worker discovered, both pools known
        results, wall, skipped = asyncio.run(rt.replay(url, args.model_name, rows, prompts, args))
        front = scrape(url)
        workers = [scrape(u) for u in metrics_urls]
    finally:
        procs.stop()

    ok = [r for r, _ in results if r.ok]
    ttft = [(r.t_first - r.t_send) * 1000 for r in ok if not math.isnan(r.t_first)]
    itl = [(r.t_last - r.t_first) * 1000 / (r.tokens - 1) for r in ok
           if r.tokens > 1 and not math.isnan(r.t_last)]
    t0 = min((r.t_send for r, _ in results), default=0.0)
    t1 = max((r.t_end for r in ok if not math.isnan(r.t_end)), default=t0)
    span = max(1e-9, t1 - t0) if ok else wall

    def total(texts: list[str], name: str) -> float:
        return sum(rt.metric_sum(t, name) or 0.0 for t in texts)

    if args.engine == "vllm":
        kv_bytes, kv_seconds = vllm_pulls(logdir)
        wire_bytes = kv_bytes
    else:
        wire_bytes = total(workers, "dynamo_component_kv_transfer_received_bytes")
        kv_bytes = (total(workers, "mocker_remote_prefill_blocks")
                    * args.tokens_per_block * args.kv_bytes_per_token)
        kv_seconds = total(workers, "mocker_kv_transfer_modeled_seconds")
    errs: dict[str, int] = {}
    for r, _ in results:
        if not r.ok:
            key = re.sub(r"\d+", "N", r.error or "unknown")[:120]
            errs[key] = errs.get(key, 0) + 1
    return {
        "errors": errs, "mode": mode, "sent": len(results), "ok": len(ok),
        "failed": len(results) - len(ok),
        "not_sent": skipped, "wall_s": wall, "out_tok_s": sum(r.tokens for r in ok) / span,
        "ttft_p50_ms": be.pct(ttft, 0.5), "ttft_p99_ms": be.pct(ttft, 0.99),
        "itl_p50_ms": be.pct(itl, 0.5), "itl_p99_ms": be.pct(itl, 0.99),
        "remote_prefills": total([front], "dynamo_frontend_remote_prefills"),
        "local_prefills": total([front], "dynamo_frontend_local_prefills"),
        "wire_bytes": wire_bytes, "kv_bytes": kv_bytes, "kv_seconds": kv_seconds,
    }


def table(res: list[dict]) -> str:
    cols = ["mode", "ok", "failed", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
            "ITL p99 ms", "remote prefills", "local prefills", "KV MB",
            "transfer s", "wire MB"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in res:
        lines.append("| " + " | ".join([
            r["mode"], str(r["ok"]), str(r["failed"]), rt.fmt(r["out_tok_s"]),
            rt.fmt(r["ttft_p50_ms"]), rt.fmt(r["ttft_p99_ms"]), rt.fmt(r["itl_p50_ms"], 2),
            rt.fmt(r["itl_p99_ms"], 2), rt.fmt(r["remote_prefills"], 0),
            rt.fmt(r["local_prefills"], 0), rt.fmt(r["kv_bytes"] / 1e6, 1),
            rt.fmt(r["kv_seconds"], 2), rt.fmt(r["wire_bytes"] / 1e6, 2),
        ]) + " |")
    return "\n".join(lines)


def plot(res: list[dict], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["mode"] for r in res]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (key50, key99, title) in zip(axes, [
        ("ttft_p50_ms", "ttft_p99_ms", "TTFT (ms)"), ("itl_p50_ms", "itl_p99_ms", "ITL (ms)"),
    ], strict=False):
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [r[key50] for r in res], 0.4, label="p50")
        ax.bar([x + 0.2 for x in xs], [r[key99] for r in res], 0.4, label="p99")
        ax.set_xticks(list(xs), names)
        ax.set_title(title)
        ax.legend()
    axes[2].bar(names, [r["out_tok_s"] for r in res])
    axes[2].set_title("output tok/s")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=DEFAULT_TRACE)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--max-requests", type=int, default=60)
    p.add_argument("--max-seconds", type=float, default=90.0)
    p.add_argument("--speedup", type=float, default=1.0, help="trace time / this")
    p.add_argument("--engine", choices=["mocker", "vllm"], default="mocker")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--tokens-per-block", type=int, default=128,
                   help="tokens per trace hash id (a 512-token block in the trace) and KV block")
    p.add_argument("--context-length", type=int, default=32768)
    p.add_argument("--max-output", type=int, default=64)
    p.add_argument("--mocker-speedup", type=float, default=1.0)
    p.add_argument("--num-gpu-blocks", type=int, default=4096)
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--bandwidth", type=float, default=10.0, help="KV transfer GB/s (mocker)")
    p.add_argument("--kv-bytes-per-token", type=int, default=131072,
                   help="the mocker's modeled KV size (Llama-3-8B in bf16)")
    p.add_argument("--max-local-prefill", type=int, default=512,
                   help="conditional mode: uncached tokens prefilled locally")
    p.add_argument("--max-prefill-queue", type=int, default=2,
                   help="conditional mode: prefill pool busy above this in flight per worker")
    p.add_argument("--max-inflight", type=int, default=256)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--settle", type=float, default=2.0)
    p.add_argument("--modes", default="agg,disagg,conditional")
    p.add_argument("--model-name", default="bench-disagg")
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args()

    rows = rt.load_trace(args.trace, args.start, args.max_requests)
    if not rows:
        print("no rows in the trace", file=sys.stderr)
        return 1
    from dynamo_zmq.tools.tiny_model import build_tiny_model

    logroot = Path(os.environ.get("BENCH_LOGS", f"/tmp/bench_disagg-{os.getpid()}"))
    if args.engine == "vllm":
        os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    model_dir = build_tiny_model(logroot / "model", max_position_embeddings=args.context_length)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    gen = rt.Prompts(args.tokens_per_block, vocab)
    prompts = [gen.build(r) for r in rows]
    res = []
    for mode in args.modes.split(","):
        res.append(run_mode(mode, rows, prompts, args, model_dir, logroot))
        print(f"{mode}: done", file=sys.stderr)
    print(f"{len(rows)} requests from {Path(args.trace).name}, prompts "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, {args.workers} workers, "
          + ("vLLM (tiny model, CPU)" if args.engine == "vllm" else
             f"mocker speedup {args.mocker_speedup}, KV bandwidth {args.bandwidth} GB/s"))
    print(table(res))
    for r in res:
        for error, n in r["errors"].items():
            print(f"{r['mode']}: {n} failed: {error}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    if args.plot:
        plot(res, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
