"""Replay a Mooncake-format trace against N mocker workers under each router mode.

    python scripts/bench_router_trace.py [--trace /work/shared/traces/synthetic_trace.jsonl]
        [--start 0] [--max-requests 300] [--warmup 0] [--restart-after-warmup]
        [--max-seconds 120] [--speedup 10]
        [--workers 4] [--dp 1] [--tokens-per-block 64] [--max-output 32]
        [--mocker-speedup 2] [--num-gpu-blocks 512] [--modes round-robin,random,kv,approx]
        [--frontends 1] [--no-replica-sync] [--prefill-ms-per-token 0]
        [--router-args "--kv-overlap-score-weight 2"]
        [--oracle-window 32] [--oracle-slack 1.5] [--bounds-only] [--json OUT] [--plot OUT.png]

Trace rows: ``{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}``, each hash
id one 512-token block; equal ids at equal positions mean a shared prefix. Prompts are token-id
lists: hash id ``h`` maps to ``--tokens-per-block`` ids drawn from ``random.Random(h)`` (values in
``[1, vocab)``), so equal ids give equal blocks; the last block is cut in proportion to the
trace's partial last block. The mocker runs with ``--block-size`` = ``--tokens-per-block``.
Arrivals follow the trace timestamps divided by ``--speedup`` (open loop); outputs are
``min(output_length, --max-output)`` tokens (``min_tokens`` = ``max_tokens``, ``ignore_eos``).

``--warmup N`` replays the N rows before ``--start`` first, in the same open-loop stream and
through the same router, so the window is measured on caches that hold what the trace sent
before it (as a serving fleet's caches do); every figure below (TTFT, hit rate, the bounds)
counts only the window's requests, while failures count over all of them. With
``--restart-after-warmup`` the warm-up rows finish first and the frontends are then replaced by
new ones, which route the window: a kv frontend rebuilds its index from the workers (a full
dump on subscribing), an approximate one starts knowing nothing the caches hold.

Each mode runs on a fresh set of processes (N workers + one frontend, own namespace; with
``--frontends N``, N frontends taking requests in turn, in kv modes with
``--router-replica-sync`` unless ``--no-replica-sync``); all are stopped by pid (SIGTERM, then
SIGKILL) when the mode ends, and again on exit.

Reported per mode: requests ok / failed, req/s, output tok/s, TTFT p50/p99, and the achieved
prefix hit rate next to the infinite-cache upper bound of the replayed subset (full blocks of the
scaled prompts whose whole prefix appeared in an earlier replayed request). The achieved rate is
taken from ``usage.prompt_tokens_details.cached_tokens`` when the frontend sends it; otherwise
from the KV router's ``dynamo_router_matched_blocks / dynamo_router_prompt_blocks`` on the
frontend's /metrics (kv modes only: the router's view at decision time, marked ``~``); else n/a.

Next to it, the finite-capacity bound (``router.oracle.finite_bound``): a heuristic clairvoyant
placement of the same requests on ``--workers`` x ``--dp`` caches of ``--num-gpu-blocks``
blocks each, no worker taking more than ``ceil(--oracle-slack x --oracle-window / caches)`` of
any ``--oracle-window`` consecutive requests; "gap" is the achieved rate / that bound.
``--prefill-ms-per-token`` is passed to the mockers (a flat prefill cost per uncached token, so
prefix hits show in TTFT); ``--router-args`` are added to the frontend's flags in the kv modes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_e2e as be  # its asyncio HTTP/SSE client

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from router.oracle import BALANCES, block_keys, finite_bound, infinite_bound, simulate

ROOT = Path(__file__).resolve().parent.parent
MODES = {
    "round-robin": ["--router-mode", "round-robin"],
    "random": ["--router-mode", "random"],
    "kv": ["--router-mode", "kv"],
    "approx": ["--router-mode", "kv", "--no-kv-events"],
}

# -- capture cached_tokens from the usage chunk (the engine's prefix-cache hits) -------------

_cached: contextvars.ContextVar[dict | None] = contextvars.ContextVar("cached", default=None)
_orig_read_chunk = be._read_chunk


def _read_chunk(payload: bytes):  # type: ignore[no-untyped-def]
    out = _orig_read_chunk(payload)
    if b"cached_tokens" in payload:
        box = _cached.get()
        if box is not None:
            try:
                d = json.loads(payload).get("usage") or {}
                ct = (d.get("prompt_tokens_details") or {}).get("cached_tokens")
                if ct is None:
                    ct = d.get("cached_tokens")
                if ct is not None:
                    box["cached"] = int(ct)
            except (ValueError, AttributeError):
                pass
    return out


be._read_chunk = _read_chunk

# -- trace ------------------------------------------------------------------------------------


def load_trace(path: str, start: int, n: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with open(path) as fh:
        for i, line in enumerate(fh):
            if i < start:
                continue
            if len(rows) >= n:
                break
            if line.strip():
                rows.append(json.loads(line))
    return rows


class Prompts:
    def __init__(self, tpb: int, vocab: int) -> None:
        self.tpb, self.vocab = tpb, vocab
        self.cache: dict[int, list[int]] = {}

    def block(self, h: int) -> list[int]:
        b = self.cache.get(h)
        if b is None:
            rng = random.Random(h * 1_000_003 + 17)
            b = self.cache[h] = [rng.randrange(1, self.vocab) for _ in range(self.tpb)]
        return b

    def build(self, row: dict[str, Any]) -> list[int]:
        ids = row["hash_ids"]
        toks: list[int] = []
        for h in ids[:-1]:
            toks += self.block(h)
        if ids:
            part = row["input_length"] - 512 * (len(ids) - 1)
            keep = max(1, min(self.tpb, math.ceil(part * self.tpb / 512)))
            toks += self.block(ids[-1])[:keep]
        return toks


# -- processes --------------------------------------------------------------------------------


class Procs:
    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, args: list[str], timeout: float) -> str:
        env = dict(os.environ, DYN_MDNS_INTERFACES="127.0.0.1", PYTHONUNBUFFERED="1")
        err = open(self.logdir / f"{name}.log", "wb")
        p = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=err, env=env,
                             cwd=ROOT, start_new_session=True)
        self.procs.append(p)
        box: list[str] = []

        def reader() -> None:
            assert p.stdout is not None
            for raw in p.stdout:  # ends when the process exits
                line = raw.decode(errors="replace").strip()
                if line.startswith("READY") and not box:
                    box.append(line)

        threading.Thread(target=reader, daemon=True).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not box:
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited rc={p.returncode}; see {self.logdir}/{name}.log")
            time.sleep(0.05)
        if not box:
            raise RuntimeError(f"{name} not READY within {timeout}s; see {self.logdir}/{name}.log")
        return box[0]

    def stop(self, which: list[subprocess.Popen] | None = None) -> None:
        """Stop ``which`` of the processes started (default: all of them)."""
        stopping = list(self.procs if which is None else which)
        self.procs = [p for p in self.procs if p not in stopping]
        for p in stopping:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for p in stopping:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=5)


def http_get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # loopback only
        return r.read()


def wait_listed(url: str, model: str, timeout: float = 30.0) -> None:
    """Wait until the frontend at ``url`` lists ``model``; RuntimeError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if model.encode() in http_get(url + "/v1/models"):
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("frontend never listed the model")


def metric_sum(text: str, name: str) -> float | None:
    total, found = 0.0, False
    for line in text.splitlines():
        if (
            line.startswith(name + "_total")
            or line.startswith(name + "{")
            or line.startswith(name + " ")
        ):
            if line.startswith(name + "_created"):
                continue
            try:
                total += float(line.rsplit(" ", 1)[1])
                found = True
            except ValueError:
                pass
    return total if found else None


# -- one mode ---------------------------------------------------------------------------------


async def replay(
    url: str | list[str], model: str, rows: list[dict], prompts: list[list[int]],
    args: argparse.Namespace, warmup: int = 0,
):
    """Send ``rows`` open loop; the first ``warmup`` are marked unmeasured (``box["measured"]``)."""
    fronts = [(u.hostname or "127.0.0.1", u.port or 80)
              for u in map(be.urlsplit, [url] if isinstance(url, str) else url)]
    turn = iter(range(1 << 62))
    t0_trace = rows[0]["timestamp"]
    results: list[tuple[be.Result, dict]] = []
    sem = asyncio.Semaphore(args.max_inflight)

    async def one(row: dict, prompt: list[int], measured: bool) -> None:
        out = max(1, min(int(row["output_length"]), args.max_output))
        host, port = fronts[next(turn) % len(fronts)]  # --frontends N: alternate between them
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": out, "min_tokens": out,
                           "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        res = be.Result(ok=False, t_send=time.perf_counter())
        box: dict = {"prompt_len": len(prompt), "measured": measured}
        _cached.set(box)
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

    tasks: list[asyncio.Task] = []
    start = time.perf_counter()
    for i, (row, prompt) in enumerate(zip(rows, prompts, strict=True)):
        due = start + (row["timestamp"] - t0_trace) / 1000.0 / args.speedup
        now = time.perf_counter()
        if now - start > args.max_seconds:
            break
        if due > now:
            await asyncio.sleep(due - now)
        tasks.append(asyncio.create_task(one(row, prompt, i >= warmup)))
    left = max(1.0, args.max_seconds + args.request_timeout - (time.perf_counter() - start))
    _done, pending = await asyncio.wait(tasks, timeout=left) if tasks else (set(), set())
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    wall = time.perf_counter() - start
    return results, wall, len(rows) - len(tasks)


def start_frontends(procs: Procs, ns: str, mode: str, args: argparse.Namespace,
                    tag: str = "") -> tuple[list[str], list[subprocess.Popen]]:
    """``--frontends N`` frontends of ``mode`` (kv modes: with ``--router-replica-sync`` unless
    ``--no-replica-sync``), once they list the model and had ``--settle`` seconds to find every
    worker; their URLs and processes. Requests alternate between them."""
    sync = (["--router-replica-sync"]
            if args.frontends > 1 and "kv" in MODES[mode] and args.replica_sync else [])
    urls = []
    for i in range(args.frontends):
        line = procs.start(f"frontend{i or ''}{tag}", [
            "-m", "dynamo_zmq.frontend", "--http-host", "127.0.0.1",
            "--http-port", "0", "--namespace", ns, *MODES[mode], *sync, *router_args(mode, args),
        ], timeout=60)
        urls.append(line.split()[1])
    started = procs.procs[-args.frontends:]
    wait_listed(urls[0], args.model_name)
    time.sleep(args.settle)  # let every worker be discovered (and KV subscriptions connect)
    return urls, started


def run_mode(mode: str, rows: list[dict], prompts: list[list[int]], args: argparse.Namespace,
             model_dir: Path, logroot: Path) -> dict[str, Any]:
    logdir = logroot / mode
    logdir.mkdir(parents=True, exist_ok=True)
    ns = f"rtrace-{mode}-{os.getpid()}-{int(time.time())}"
    procs = Procs(logdir)
    try:
        for i in range(args.workers):
            procs.start(f"worker{i}", [
                "-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path", str(model_dir),
                "--model-name", args.model_name, "--namespace", ns, "--host", "127.0.0.1",
                "--speedup-ratio", str(args.mocker_speedup),
                "--block-size", str(args.tokens_per_block),
                "--num-gpu-blocks-override", str(args.num_gpu_blocks),
                "--data-parallel-size", str(args.dp),
                "--max-num-batched-tokens", str(args.max_batched_tokens),
                "--prefill-ms-per-token", str(args.prefill_ms_per_token),
            ], timeout=60)
        urls, fronts = start_frontends(procs, ns, mode, args)
        if args.restart_after_warmup and args.warmup:
            # The warm-up rows through these frontends, then new ones for the window: a kv
            # frontend rebuilds its index from the workers, an approximate one starts empty.
            w = args.warmup
            results, wall, skipped = asyncio.run(
                replay(urls, args.model_name, rows[:w], prompts[:w], args, w))
            procs.stop(fronts)
            urls, fronts = start_frontends(procs, ns, mode, args, tag="-restarted")
            more, wall2, skipped2 = asyncio.run(
                replay(urls, args.model_name, rows[w:], prompts[w:], args, 0))
            results, wall, skipped = results + more, wall + wall2, skipped + skipped2
        else:
            results, wall, skipped = asyncio.run(
                replay(urls, args.model_name, rows, prompts, args, args.warmup))
        try:
            mtext = "\n".join(http_get(u + "/metrics").decode() for u in urls)
        except OSError:
            mtext = ""
    finally:
        procs.stop()

    ok = [r for r, _ in results if r.ok]
    window = [(r, b) for r, b in results if b["measured"]]  # --warmup rows only fill caches
    ttft = [(r.t_first - r.t_send) * 1000 for r, _ in window
            if r.ok and not math.isnan(r.t_first)]
    errs: dict[str, int] = {}
    for r, _ in results:
        if not r.ok:
            key = re.sub(r"\d+", "N", (r.error or "unknown"))[:80]
            errs[key] = errs.get(key, 0) + 1
    cached = [(b["cached"], b["prompt_len"]) for r, b in window if r.ok and "cached" in b]
    hit, hit_src = None, "n/a"
    if cached and len(cached) == sum(r.ok for r, _ in window):
        full = sum(pl // args.tokens_per_block * args.tokens_per_block for _, pl in cached)
        hit, hit_src = (sum(c for c, _ in cached) / full if full else 0.0), "usage"
    else:
        mb = metric_sum(mtext, "dynamo_router_matched_blocks")
        pb = metric_sum(mtext, "dynamo_router_prompt_blocks")
        if mb is not None and pb:
            hit, hit_src = mb / pb, "router"
    w_ok = [r for r, _ in window if r.ok]
    t_first_send = min((r.t_send for r, _ in window), default=0.0)
    t_last_end = max((r.t_end for r in w_ok if not math.isnan(r.t_end)), default=t_first_send)
    span = max(1e-9, t_last_end - t_first_send) if w_ok else wall
    return {
        "mode": mode, "sent": len(results), "ok": len(ok), "failed": len(results) - len(ok),
        "not_sent": skipped, "errors": errs, "wall_s": wall, "span_s": span,
        "req_s": len(w_ok) / span, "out_tok_s": sum(r.tokens for r in w_ok) / span,
        "ttft_p50_ms": be.pct(ttft, 0.5), "ttft_p99_ms": be.pct(ttft, 0.99),
        "ttft_mean_ms": (sum(ttft) / len(ttft)) if ttft else math.nan,
        "hit_rate": hit, "hit_source": hit_src,
    }


def router_args(mode: str, args: argparse.Namespace) -> list[str]:
    """``--router-args`` for the kv modes (tuning flags of the KV router), nothing otherwise."""
    return args.router_args.split() if mode in ("kv", "approx") and args.router_args else []


def bounds(prompts: list[list[int]], args: argparse.Namespace) -> dict[str, float]:
    """The infinite-cache bound and the oracle's finite-capacity bound of the replayed prompts,
    and, for reference, round-robin, the online greedy placement (what an ideal event-driven
    router reaches on engines that evict LRU) and the approximate one (greedy on what was sent,
    as a router without events) in the same simulator with LRU caches, each at the best of
    the oracle's balance terms."""
    keys = block_keys(prompts, args.tokens_per_block)
    caches, cap, warm = args.workers * args.dp, args.num_gpu_blocks, args.warmup
    fin = finite_bound(keys, caches, cap, window=args.oracle_window, slack=args.oracle_slack,
                       measure_from=warm)
    sims = {f"sim_{p}_lru": max(simulate(keys, caches, cap, p, "lru", args.oracle_window,
                                         args.oracle_slack, warm, b).rate
                                for b in (BALANCES if p != "round-robin" else (0.0,)))
            for p in ("round-robin", "greedy", "approx")}
    return {"infinite": infinite_bound(keys, warm), "finite": fin.rate, **sims}


def fmt(x: Any, nd: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{nd}f}"


def table(res: list[dict], bound: float, finite: float | None = None) -> str:
    out = ["| mode | ok | failed | not sent | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | "
           "hit rate | bound | finite bound | gap |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res:
        h = (
            "n/a" if r["hit_rate"] is None
            else ("~" if r["hit_source"] == "router" else "") + f"{100 * r['hit_rate']:.1f}%"
        )
        out.append(f"| {r['mode']} | {r['ok']} | {r['failed']} | {r['not_sent']} | "
                   f"{fmt(r['req_s'], 2)} | {fmt(r['out_tok_s'])} | {fmt(r['ttft_p50_ms'])} | "
                   f"{fmt(r['ttft_p99_ms'])} | {h} | {100 * bound:.1f}% | "
                   f"{'n/a' if finite is None else f'{100 * finite:.1f}%'} | {gap(r, finite)} |")
    return "\n".join(out)


def gap(r: dict, finite: float | None) -> str:
    """Achieved hit rate / the finite-capacity bound, as a percentage."""
    if r["hit_rate"] is None or not finite:
        return "n/a"
    return f"{100 * r['hit_rate'] / finite:.0f}%"


def plot(res: list[dict], bound: float, out: str, finite: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [r["mode"] for r in res]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    xs = range(len(modes))
    a.bar([x - 0.2 for x in xs], [r["ttft_p50_ms"] for r in res], 0.4, color="tab:blue",
          label="p50")
    a.bar([x + 0.2 for x in xs], [r["ttft_p99_ms"] for r in res], 0.4, color="tab:orange",
          label="p99")
    a.set_xticks(list(xs), modes)
    a.set_title("TTFT (ms)")
    a.legend()
    b.bar(modes, [100 * (r["hit_rate"] or 0) for r in res], color="tab:green")
    b.axhline(100 * bound, color="k", ls="--", label="infinite-cache bound")
    if finite is not None:
        b.axhline(100 * finite, color="tab:red", ls=":", label="finite-capacity bound (oracle)")
    b.set_title("prefix hit rate (%)")
    b.set_ylim(0, 100)
    b.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def tiny_model(work: Path, args: argparse.Namespace) -> Path:
    """The mockers' tiny model under ``work`` (built once), its context widened for the trace's
    prompts (they exceed the tiny model's 2048 positions)."""
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"
    if not (model_dir / "config.json").exists():
        subprocess.run([sys.executable, "-m", "dynamo_zmq", "tiny-model", str(model_dir),
                        "--vocab-size", str(args.vocab_size)], check=True, cwd=ROOT, timeout=120)
    cfg_path = model_dir / "config.json"
    mcfg = json.loads(cfg_path.read_text())
    if mcfg.get("max_position_embeddings", 0) < args.context_length:
        mcfg["max_position_embeddings"] = args.context_length
        cfg_path.write_text(json.dumps(mcfg, indent=2))
    return model_dir


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="/work/shared/traces/synthetic_trace.jsonl")
    ap.add_argument("--start", type=int, default=0, help="first trace row")
    ap.add_argument("--max-requests", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=0,
                    help="replay this many rows before --start first, unmeasured (warm caches)")
    ap.add_argument("--restart-after-warmup", action="store_true",
                    help="replace the frontends between the warm-up rows and the window")
    ap.add_argument("--max-seconds", type=float, default=120.0,
                    help="stop issuing after this (per mode)")
    ap.add_argument("--speedup", type=float, default=10.0, help="arrival time compression")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--tokens-per-block", type=int, default=64)
    ap.add_argument("--max-output", type=int, default=32)
    ap.add_argument("--mocker-speedup", type=float, default=2.0, help="mocker --speedup-ratio")
    ap.add_argument("--num-gpu-blocks", type=int, default=512, help="KV blocks per worker rank")
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--vocab-size", type=int, default=3000)
    ap.add_argument("--modes", default="round-robin,random,kv,approx")
    ap.add_argument("--context-length", type=int, default=262144,
                    help="patched into the tiny model")
    ap.add_argument("--model-name", default="trace-model")
    ap.add_argument("--max-inflight", type=int, default=256)
    ap.add_argument("--request-timeout", type=float, default=60.0)
    ap.add_argument("--settle", type=float, default=2.0)
    ap.add_argument("--workdir", default=str(ROOT / ".bench" / "router_trace"))
    ap.add_argument("--frontends", type=int, default=1,
                    help="frontends per mode; requests alternate between them")
    ap.add_argument("--no-replica-sync", dest="replica_sync", action="store_false",
                    help="with --frontends > 1 in kv modes: no --router-replica-sync")
    ap.add_argument("--prefill-ms-per-token", type=float, default=0.0,
                    help="mocker flat prefill cost per uncached token (0: Dynamo's fit)")
    ap.add_argument("--router-args", default="",
                    help="extra frontend flags in the kv modes, e.g. '--kv-overlap-score-weight 2'")
    ap.add_argument("--oracle-window", type=int, default=32,
                    help="the finite bound's balance window (requests)")
    ap.add_argument("--oracle-slack", type=float, default=1.5,
                    help="the finite bound's balance factor (<= slack x window / caches each)")
    ap.add_argument("--bounds-only", action="store_true",
                    help="print the bounds and the simulated placements, run no mode")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            ap.error(f"unknown mode {m!r}; choose from {sorted(MODES)}")

    if not 0 <= args.warmup <= args.start:
        ap.error("--warmup must be between 0 and --start")
    rows = load_trace(args.trace, args.start - args.warmup, args.warmup + args.max_requests)
    if len(rows) <= args.warmup:
        print("no trace rows", file=sys.stderr)
        return 1
    pm = Prompts(args.tokens_per_block, args.vocab_size)
    prompts = [pm.build(r) for r in rows]
    bnd = bounds(prompts, args)
    bound, finite = bnd["infinite"], bnd["finite"]
    span = (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000 / args.speedup
    measured = prompts[args.warmup:]
    warm = (f" after {args.warmup} warm-up rows from {args.start - args.warmup}"
            if args.warmup else "")
    print(f"trace {Path(args.trace).name} rows {args.start}..{args.start + len(measured) - 1}"
          f"{warm}: {len(rows)} requests over {span:.1f}s replayed, mean prompt "
          f"{sum(map(len, measured)) / len(measured):.0f} tokens, "
          f"infinite-cache bound {100 * bound:.1f}%, finite-capacity bound {100 * finite:.1f}% "
          f"({args.workers * args.dp} caches of {args.num_gpu_blocks} blocks); simulated with "
          f"LRU caches: round-robin {100 * bnd['sim_round-robin_lru']:.1f}%, online greedy "
          f"{100 * bnd['sim_greedy_lru']:.1f}%, approximate {100 * bnd['sim_approx_lru']:.1f}%",
          flush=True)
    if args.bounds_only:
        return 0

    work = Path(args.workdir)
    model_dir = tiny_model(work, args)
    res: list[dict] = []
    for m in modes:
        t = time.monotonic()
        try:
            r = run_mode(m, rows, prompts, args, model_dir, work / "logs")
        except RuntimeError as exc:
            print(f"{m}: FAILED to run: {exc}", flush=True)
            continue
        res.append(r)
        print(f"{m}: ok {r['ok']} failed {r['failed']} TTFT p50 {fmt(r['ttft_p50_ms'])} ms "
              f"({time.monotonic() - t:.0f}s)"
              f"{' errors ' + str(r['errors']) if r['errors'] else ''}", flush=True)

    cfg = {k: v for k, v in vars(args).items() if k not in ("json", "plot")}
    print()
    print(table(res, bound, finite))
    print("\nhit rate: the engines' cached_tokens / prompt tokens (full blocks); `~` = the KV "
          "router's matched/prompt blocks at decision time, where no cached_tokens came back; "
          "n/a = no measure for this mode.")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"config": cfg, "bound": bound, "finite_bound": finite, "bounds": bnd,
                        "results": res}, indent=2)
        )
    if args.plot and res:
        try:
            plot(res, bound, args.plot, finite)
        except ImportError:
            print("matplotlib missing: no plot", file=sys.stderr)
    return 0 if res else 1


if __name__ == "__main__":
    sys.exit(main())
