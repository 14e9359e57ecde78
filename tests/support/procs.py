"""Start real processes for tests and always stop them, by pid."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from dynamo_zmq.tools.child_process import ChildProcess

ROOT = Path(__file__).resolve().parents[2]


def pythonpath(env: dict[str, str] | None = None) -> str:
    """``PYTHONPATH`` for children: this checkout first, so they import its code."""
    return str(ROOT) + os.pathsep + {**os.environ, **(env or {})}.get("PYTHONPATH", "")


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (each thread's: a thread may have started them)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


class Proc(ChildProcess):
    """A child Python process that prints ``READY <address> <instance hex>`` when serving."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        full_env = {**os.environ, **(env or {}), "PYTHONPATH": pythonpath(env)}
        super().__init__([sys.executable, *args], env=full_env, cwd=ROOT)

    def wait_ready(self, timeout: float = 30.0, count: int = 1) -> Proc:
        super().wait_ready(timeout, count)
        return self


def system_port(proc: ChildProcess) -> int:
    """The port a ready worker serves ``/metrics`` and ``/health`` on (asked for as port 0:
    ``--metrics-port 0``, ``--system-port 0`` or ``DYN_SYSTEM_PORT=0``), from its log."""
    return int(next(line.split()[-1] for line in proc.logs().splitlines()
                    if "metrics and health on port" in line))


def run_cli(
    *args: str, timeout: float = 60.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS...`` to completion (``env``: variables added to the test's); the child
    is stopped by pid whatever happens."""
    env = {**os.environ, "DYN_MDNS_INTERFACES": "127.0.0.1", **(env or {})}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def status_json(*args: str) -> list[dict[str, Any]]:
    """``python -m dynamo_zmq status --json ARGS...``'s rows; asserts it exits 0."""
    result = run_cli("-m", "dynamo_zmq", "status", "--json", *args)
    assert result.returncode == 0, result.stderr
    rows: list[dict[str, Any]] = json.loads(result.stdout)
    return rows
