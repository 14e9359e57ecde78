"""``python -m dynamo_zmq quickstart``: a frontend and a mocker worker on a tiny local model.

Builds the tiny model (a BPE tokenizer and random Llama weights, no download), starts
``python -m dynamo_zmq.worker --engine mocker`` and ``python -m dynamo_zmq.frontend`` as child
processes (mDNS pinned to loopback), waits until the model is served, and prints a curl command
that works. It then runs until Ctrl-C, and stops both children by pid.

    --check      send one chat request itself, print the answer, and exit (used by the tests)
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from .child_process import die_with_parent_hook
from .tiny_model import build_tiny_model

MODEL = "tiny-llama"


def _start(args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    # Killed with this process (even by SIGKILL): no worker or frontend is left behind.
    return subprocess.Popen(
        [sys.executable, *args], env=env, stdout=subprocess.PIPE,
        preexec_fn=die_with_parent_hook(),
    )


def _wait_ready(proc: subprocess.Popen[bytes], what: str, timeout: float = 60.0) -> str:
    """The address on ``proc``'s READY line; RuntimeError if it exits first, TimeoutError if it
    says nothing for ``timeout`` seconds (a child that hangs cannot hang this process)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([proc.stdout], [], [], left)[0]:
            break
        line = proc.stdout.readline().decode()
        if line.startswith("READY "):
            return line.split()[1]
        if not line:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
            raise RuntimeError(f"{what} exited with {proc.returncode}")
    raise TimeoutError(f"{what} not ready after {timeout}s")


def _wait_model(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as resp:
                if any(m["id"] == MODEL for m in json.load(resp)["data"]):
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"model {MODEL} not served after {timeout}s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dynamo_zmq quickstart", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument(
        "--model-dir", default=str(Path(tempfile.gettempdir()) / "dynamo-zmq-tiny-model")
    )
    parser.add_argument(
        "--check", action="store_true", help="send one request, print the answer, exit"
    )
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # stop the children as Ctrl-C does

    model_dir = build_tiny_model(Path(args.model_dir))
    namespace = f"quickstart{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "DYN_MDNS_INTERFACES": os.environ.get("DYN_MDNS_INTERFACES", "127.0.0.1")}
    # One machine, loopback only: auth stays off whatever the environment says.
    env = {k: v for k, v in env.items() if k not in ("DYN_AUTH_KEYS", "DYN_AUTH_KEY_NAME")}
    worker = _start(
        ["-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path", str(model_dir),
         "--model-name", MODEL, "--namespace", namespace, "--speedup-ratio", "10"],
        env,
    )
    frontend = _start(
        ["-m", "dynamo_zmq.frontend", "--http-port", str(args.http_port),
         "--namespace", namespace],
        env,
    )
    try:
        _wait_ready(worker, "worker")
        url = _wait_ready(frontend, "frontend")
        _wait_model(url)
        body = {
            "model": MODEL, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16
        }
        curl = (
            f"curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' "
            f"-d '{json.dumps(body)}'"
        )
        print(f"\nServing {MODEL} (mocker engine) at {url}. Try:\n\n  {curl}\n", flush=True)
        if args.check:
            request = urllib.request.Request(
                f"{url}/v1/chat/completions",
                json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=30) as resp:
                answer = json.load(resp)
            print(json.dumps(answer, indent=2), flush=True)
            return 0
        print("Ctrl-C stops the frontend and the worker.", flush=True)
        while worker.poll() is None and frontend.poll() is None:
            time.sleep(0.5)
        return 1  # a child died
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as exc:  # a child failed to start (its error is above)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        # Ctrl-C reaches the children too (same process group); a second one must not cut the
        # clean-up short and leave them running.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _stop(frontend)
        _stop(worker)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt

