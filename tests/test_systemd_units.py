"""The systemd units of scripts/systemd (issue 31 item 5): ``systemd-analyze verify`` accepts
them (with ExecStart pointed at this checkout's virtual environment, as an install would),
their stop timeout outlasts the graceful shutdown the environment file sets, and a worker and
a frontend started the way the units start them (the environment file's variables, the GPU
index as ``CUDA_VISIBLE_DEVICES``, SIGTERM to stop) serve and stop cleanly in time.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.http_calls import get
from tests.support.procs import ROOT, Proc

UNITS = ROOT / "scripts" / "systemd"
INSTALLED_BIN = "/opt/dynamo-zmq/.venv/bin/"


def unit_settings(path: Path) -> dict[str, list[str]]:
    """``key -> values`` of a unit file's assignments (every section)."""
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def env_file(path: Path) -> dict[str, str]:
    """The variables of an EnvironmentFile= (``KEY=value`` lines, ``#`` comments)."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            found[key] = value
    return found


@pytest.fixture
def installed(tmp_path: Path) -> Path:
    """The units as an install would have them: ExecStart in this checkout's environment."""
    if shutil.which("systemd-analyze") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("systemd-analyze is not installed (the systemd package)")
        pytest.skip("systemd-analyze is not installed (the systemd package)")
    bindir = str(Path(sys.executable).parent) + "/"
    for unit in UNITS.glob("*.service"):
        (tmp_path / unit.name).write_text(unit.read_text().replace(INSTALLED_BIN, bindir))
    return tmp_path


@pytest.mark.parametrize("unit", ["dynamo-worker@0.service", "dynamo-frontend.service"])
def test_systemd_analyze_verify_accepts_the_units(installed: Path, unit: str) -> None:
    done = subprocess.run(["systemd-analyze", "verify", "--man=no", str(installed / unit)],
                          capture_output=True, text=True, timeout=60, cwd=installed)
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), (
        done.stdout + done.stderr)


def test_systemd_analyze_verify_catches_a_broken_unit(installed: Path) -> None:
    """The check can fail: a unit whose program does not exist is refused."""
    unit = installed / "dynamo-worker@.service"
    unit.write_text(unit.read_text().replace("dynamo-zmq-worker", "no-such-program"))
    done = subprocess.run(["systemd-analyze", "verify", "--man=no",
                           str(installed / "dynamo-worker@0.service")],
                          capture_output=True, text=True, timeout=60, cwd=installed)
    assert done.returncode != 0 and "no-such-program" in done.stderr


def test_the_units_restart_on_failure_and_outlast_the_graceful_shutdown() -> None:
    env = env_file(UNITS / "dynamo.env")
    graceful = float(env["DYN_GRACEFUL_TIMEOUT"]) + float(env["DYN_GRACE_PERIOD"])
    # A stopping worker drains for the graceful timeout; a frontend gives its open HTTP
    # streams 5 s (uvicorn's graceful shutdown).
    for name, drains in (("dynamo-worker@.service", graceful), ("dynamo-frontend.service", 5)):
        unit = unit_settings(UNITS / name)
        assert unit["Restart"] == ["on-failure"]
        assert unit["EnvironmentFile"] == ["/etc/dynamo/dynamo.env"]
        assert unit["ExecStart"][0].startswith(INSTALLED_BIN)
        assert float(unit["TimeoutStopSec"][0]) > drains + 5, name
    worker = unit_settings(UNITS / "dynamo-worker@.service")
    assert "CUDA_VISIBLE_DEVICES=%i" in worker["Environment"]


def test_a_worker_and_a_frontend_run_as_the_units_run_them(tiny_model: Path, namespace: str):
    """The environment file's settings (the model and engine swapped for the mocker and a tiny
    model: no GPU here), instance 3 of the worker template, SIGTERM to stop."""
    env = {**env_file(UNITS / "dynamo.env"), "DYN_ENGINE": "mocker",
           "DYN_MODEL_PATH": str(tiny_model), "DYN_NAMESPACE": namespace,
           "DYN_MDNS_INTERFACES": "127.0.0.1", "DYN_HTTP_HOST": "127.0.0.1",
           "DYN_HTTP_PORT": "0", "DYN_GRACEFUL_TIMEOUT": "5"}
    unit = unit_settings(UNITS / "dynamo-worker@.service")
    gpu = dict(v.split("=", 1) for v in unit["Environment"])
    worker = Proc(["-m", "dynamo_zmq.worker"],
                  env={**env, **{k: v.replace("%i", "3") for k, v in gpu.items()}})
    front = Proc(["-m", "dynamo_zmq.frontend"], env=env)
    try:
        worker.wait_ready(60)
        front.wait_ready(60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status, body = get(f"{front.address}/health")
            if status == 200:
                break
            time.sleep(0.2)
        assert status == 200, body
        stop = float(unit["TimeoutStopSec"][0])
        for proc in (worker, front):
            proc.signal(signal.SIGTERM)
            assert proc.wait(stop) == 0, proc.logs()
        assert "worker stopped" in worker.logs()
    finally:
        worker.stop()
        front.stop()
