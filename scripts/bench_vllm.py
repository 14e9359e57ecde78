"""Our frontend + vLLM worker against vLLM's own OpenAI server, same model, same load, one run.

    python scripts/bench_vllm.py [--model-path DIR] [--concurrency 1,8] [--requests-per-level 100]
        [--max-tokens 64] [--prompt-tokens 100-300] [--endpoint completions] [--rounds 1]
        [--json OUT] [-- EXTRA VLLM ENGINE FLAGS]

Starts, side by side: ``python -m dynamo_zmq.worker --engine vllm`` + ``python -m
dynamo_zmq.frontend`` ("ours"), and ``python -m vllm.entrypoints.openai.api_server`` ("vllm"),
both with the same engine flags (on a CPU: ``--enforce-eager --block-size 32
--distributed-executor-backend uni --dtype float32``, and ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
For each concurrency level it runs ``scripts/bench_e2e.py`` against one server, then the other
(alternating which goes first each round), and prints output tokens/s, req/s and TTFT of both with
the ratio ours/vllm. CPU per request covers every process of each side (engine-core children
included). Without ``--model-path`` the tiny test model is built in a temporary directory.
Needs vLLM (the ``vllm`` extra) in this interpreter.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "scripts" / "bench_e2e.py"
CPU_FLAGS = ["--enforce-eager", "--block-size", "32", "--distributed-executor-backend", "uni",
             "--dtype", "float32"]
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
       "VLLM_LOGGING_STREAM": "ext://sys.stderr", "PYTHONPATH": str(ROOT)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One child process (stderr to a log file), stopped by pid."""

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.log = self.log_path.open("wb")
        self.proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                                     stderr=self.log, env={**os.environ, **ENV}, cwd=ROOT)

    def wait_line(self, prefix: str, timeout: float) -> str:
        assert self.proc.stdout is not None
        deadline, buf = time.monotonic() + timeout, b""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log_path.read_text()[-3000:]}")
            if select.select([self.proc.stdout], [], [], 0.2)[0]:
                buf += os.read(self.proc.stdout.fileno(), 4096)
                for line in buf.decode(errors="replace").splitlines():
                    if line.startswith(prefix):
                        return line
        raise TimeoutError(f"{self.name}: no {prefix!r} in {timeout} s")

    def pids(self) -> list[int]:
        try:
            import psutil

            return [
                self.proc.pid,
                *(c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)),
            ]
        except Exception:
            return [self.proc.pid]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


def wait_model(url: str, model: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as resp:
                if model in {m["id"] for m in json.loads(resp.read())["data"]}:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} never listed {model}")


def run_level(label: str, url: str, model: str, tokenizer: str, pids: dict[str, int], level: int,
              args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, str(BENCH), "--url", url, "--model", model, "--tokenizer", tokenizer,
           "--endpoint", args.endpoint, "--concurrency", str(level),
           "--requests-per-level", str(max(args.requests_per_level, level)),
           "--max-seconds", str(args.max_seconds), "--max-tokens", str(args.max_tokens),
           "--prompt-tokens", args.prompt_tokens, "--warmup", str(args.warmup),
           "--pids", ",".join(f"{k}={v}" for k, v in pids.items()), "--label", label,
           "--json", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL if not args.verbose else None)
    return json.loads(out.read_text())["levels"][0]


def cpu_ms(level: dict) -> float:
    return sum(v for k, v in level.get("cpu_ms_per_req", {}).items() if k != "client")


def ratio(a: float, b: float) -> str:
    return "-" if not b or math.isnan(a) or math.isnan(b) else f"{a / b:.2f}"


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-path")
    p.add_argument("--model-name", default="tiny")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--requests-per-level", type=int, default=100)
    p.add_argument("--max-seconds", type=float, default=60.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", default="100-300")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="completions")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--rounds", type=int, default=1, help="repeat every level this many times")
    p.add_argument("--json", help="save both sides' levels here")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("engine_flags", nargs="*",
                   help="extra vLLM engine flags for both sides (after --)")
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    model_dir = args.model_path
    if model_dir is None:
        from dynamo_zmq.tools.tiny_model import build_tiny_model

        model_dir = str(build_tiny_model(tmp / "model"))
    flags = [*CPU_FLAGS, "--max-model-len", str(args.max_model_len), *args.engine_flags]
    namespace = f"bench{os.getpid()}"
    http_ours, http_vllm = free_port(), free_port()
    servers: list[Server] = []
    try:
        worker = Server("worker", ["-m", "dynamo_zmq.worker", "--engine", "vllm",
                                   "--model-path", model_dir,
                                   "--model-name", args.model_name, "--namespace", namespace,
                                   "--host", "127.0.0.1", *flags], tmp)
        servers.append(worker)
        frontend = Server("frontend", ["-m", "dynamo_zmq.frontend", "--http-port", str(http_ours),
                                       "--namespace", namespace], tmp)
        servers.append(frontend)
        vllm = Server("vllm", ["-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                               "--served-model-name", args.model_name, "--host", "127.0.0.1",
                               "--port", str(http_vllm), "--enable-prefix-caching", *flags], tmp)
        servers.append(vllm)
        worker.wait_line("READY", 300)
        urls = {"ours": f"http://127.0.0.1:{http_ours}", "vllm": f"http://127.0.0.1:{http_vllm}"}
        for url in urls.values():
            wait_model(url, args.model_name, 300)
        pids = {
            "ours": {"frontend": frontend.proc.pid,
                     **{f"worker{i}": pid for i, pid in enumerate(worker.pids())}},
            "vllm": {f"vllm{i}": pid for i, pid in enumerate(vllm.pids())},
        }
        results: dict[str, list[dict]] = {"ours": [], "vllm": []}
        for rnd in range(args.rounds):
            for level in (int(c) for c in args.concurrency.split(",")):
                order = ["ours", "vllm"] if (rnd + level) % 2 == 0 else ["vllm", "ours"]
                for side in order:
                    lv = run_level(side, urls[side], args.model_name, model_dir, pids[side],
                                   level, args, tmp / f"{side}-{rnd}-{level}.json")
                    lv["round"] = rnd
                    results[side].append(lv)
                    print(f"  {side:5s} c={level:<3d} {lv['ok']}/{lv['requests']} ok, "
                          f"{lv['out_tok_s']:.0f} tok/s, TTFT p50 {lv['ttft_p50_ms']:.1f} ms",
                          flush=True)
    finally:
        for server in reversed(servers):
            server.stop()

    print(f"\nvLLM {_vllm_version()}, model {model_dir}, {args.endpoint}, "
          f"max_tokens {args.max_tokens}, prompt tokens {args.prompt_tokens}, "
          f"engine flags: {' '.join(flags)}")
    head = (f"{'conc':>4} {'round':>5} | {'ours tok/s':>10} {'vllm tok/s':>10} {'ratio':>5} | "
            f"{'ours req/s':>10} {'vllm req/s':>10} | {'ours TTFT50':>11} {'vllm TTFT50':>11} | "
            f"{'ours TTFT99':>11} {'vllm TTFT99':>11} | "
            f"{'ours cpu ms/req':>15} {'vllm cpu ms/req':>15}")
    print(head)
    print("-" * len(head))
    for a, b in zip(results["ours"], results["vllm"], strict=True):
        print(f"{a['concurrency']:>4} {a['round']:>5} | "
              f"{a['out_tok_s']:>10.0f} {b['out_tok_s']:>10.0f} "
              f"{ratio(a['out_tok_s'], b['out_tok_s']):>5} | "
              f"{a['req_s']:>10.2f} {b['req_s']:>10.2f} | "
              f"{a['ttft_p50_ms']:>9.1f}ms {b['ttft_p50_ms']:>9.1f}ms | "
              f"{a['ttft_p99_ms']:>9.1f}ms {b['ttft_p99_ms']:>9.1f}ms | "
              f"{cpu_ms(a):>15.1f} {cpu_ms(b):>15.1f}")
    print("ratio = ours / vllm output tokens/s (1.00 = no overhead; higher is better for ours)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


def _vllm_version() -> str:
    try:
        from importlib.metadata import version

        return version("vllm-cpu")
    except Exception:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
