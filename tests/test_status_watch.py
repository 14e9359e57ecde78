"""``python -m dynamo_zmq.status --watch`` against real processes: rendered in a real terminal
(tmux) it shows a live mocker worker with its load and drops it once the worker is SIGKILLed;
off a terminal it prints frames (JSON lines here) with a frontend's hit rate, and ends cleanly on
SIGTERM."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator

import openai
import pytest

from tests.support.procs import ROOT, Proc, pythonpath

pytestmark = pytest.mark.timeout(180)


def worker(spawn, namespace, model_dir) -> Proc:
    return spawn("-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path", str(model_dir),
                 "--model-name", "tiny", "--namespace", namespace, "--host", "127.0.0.1",
                 "--block-size", "16", "--num-gpu-blocks-override", "512",
                 "--speedup-ratio", "100")


def watch_cmd(namespace: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dynamo_zmq.status", "--watch", "--namespace", namespace,
            "--interval", "0.3", *extra]


def eventually(check: Callable[[], object], timeout: float, what: str) -> object:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"{what} not seen in {timeout}s"
        time.sleep(0.2)
    return value


@pytest.fixture
def tmux() -> Iterator[Callable[..., str]]:
    """Start one command in a detached tmux session on a server of its own (unique socket and
    session names); returns a function that captures the pane. Killed by name at teardown."""
    if shutil.which("tmux") is None:
        why = "tmux is not installed (.ci/run installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{why}; CI=true: this test must run in CI", pytrace=False)
        pytest.skip(why)
    name = f"dzwatch-{uuid.uuid4().hex[:10]}"
    tm = ["tmux", "-L", name]
    started = False

    def start(argv: list[str], env: dict[str, str]) -> None:
        nonlocal started
        shell = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        # bash waits out a child that handles Ctrl-C itself, then prints its exit status (the
        # pane's own "dead" flag is not reliable: tmux may reap the process late).
        script = (f"cd {shlex.quote(str(ROOT))} && env {shell} {shlex.join(argv)}; "
                  'echo "exited with status $?"')
        subprocess.run([*tm, "new-session", "-d", "-s", name, "-x", "220", "-y", "40",
                        shlex.join(["bash", "-c", script])], check=True, timeout=10)
        subprocess.run([*tm, "set-option", "-t", name, "remain-on-exit", "on"], check=True,
                       timeout=10)
        started = True

    def capture() -> str:
        done = subprocess.run([*tm, "capture-pane", "-p", "-t", name], capture_output=True,
                              text=True, timeout=10)
        assert done.returncode == 0, f"tmux session {name} is gone: {done.stderr}"
        return done.stdout

    def keys(*keys: str) -> None:
        subprocess.run([*tm, "send-keys", "-t", name, *keys], check=True, timeout=10)

    capture.start = start  # type: ignore[attr-defined]
    capture.keys = keys  # type: ignore[attr-defined]
    yield capture
    if started:
        subprocess.run([*tm, "kill-session", "-t", name], capture_output=True, timeout=10)
        subprocess.run([*tm, "kill-server"], capture_output=True, timeout=10)


def test_tmux_view_shows_a_live_worker_and_drops_a_killed_one(
    namespace, spawn, tiny_model, tmux
) -> None:
    proc = worker(spawn, namespace, tiny_model)
    iid = f"{proc.instance_id:x}"
    env = {"PYTHONPATH": pythonpath(), "DYN_MDNS_INTERFACES": "127.0.0.1", "TERM": "xterm"}
    tmux.start(watch_cmd(namespace), env)  # type: ignore[attr-defined]

    def row() -> str | None:
        screen = tmux()
        return next((line for line in screen.splitlines() if iid in line), None)

    # The worker's row, with its model, role, state and the numbers of its load reports
    # (0 in flight, 0 queued, 0% KV usage, 0 of 512 blocks active).
    pattern = rf"^agg\s+tiny\s+{namespace}\s+backend\s+{iid}\s+tcp://127\.0\.0\.1:\d+\s+ready" \
              r"\s+0\s+0\s+0%\s+0/512\s+-\s+\d+\.\ds$"
    found = eventually(lambda: (r := row()) is not None and re.match(pattern, r) and r,
                       30, f"the row of {iid} with its load")
    assert "ROLE" in tmux() and "INFLIGHT" in tmux(), tmux()
    assert isinstance(found, str)
    # Drawn in place: one header line however many frames went by.
    time.sleep(1)
    assert tmux().count("dynamo-zmq status --watch") == 1

    os.kill(proc.pid, signal.SIGKILL)
    eventually(lambda: row() is None and "(no live instances)" in tmux(), 30,
               f"{iid} dropped from the view")
    tmux.keys("C-c")  # type: ignore[attr-defined]
    eventually(lambda: "exited with status" in tmux(), 30, "the view's end on Ctrl-C")
    assert "exited with status 0" in tmux(), tmux()


def test_frames_are_separated_off_a_terminal(namespace) -> None:
    env = {**os.environ, "PYTHONPATH": pythonpath(), "DYN_MDNS_INTERFACES": "127.0.0.1"}
    watch = subprocess.Popen(watch_cmd(namespace), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        assert watch.stdout is not None
        lines = [watch.stdout.readline() for _ in range(8)]
        watch.send_signal(signal.SIGTERM)
        assert watch.wait(15) == 0
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait(10)
    # Two frames, each a header, the column titles and no rows, then a blank line; no escapes.
    assert [line.split(" ", 1)[0].strip() for line in lines] == [
        "dynamo-zmq", "ROLE", "(no", ""] * 2, lines
    assert not any("\x1b" in line for line in lines)


def test_frames_off_a_terminal_with_a_frontend_and_sigterm(namespace, spawn, tiny_model) -> None:
    proc = worker(spawn, namespace, tiny_model)
    front = spawn("-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace", namespace,
                  "--router-mode", "kv", ready=False).wait_ready()
    url = front.address
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    prompt = list(range(1, 65))  # four full blocks
    eventually(lambda: "tiny" in {m.id for m in client.models.list().data}, 30, "model tiny")
    for _ in range(2):  # the second is routed onto the first's cached blocks
        done = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
        assert done.choices[0].finish_reason in ("length", "stop")

    env = {**os.environ, "PYTHONPATH": pythonpath(), "DYN_MDNS_INTERFACES": "127.0.0.1"}
    watch = subprocess.Popen([*watch_cmd(namespace, "--json", "--frontend", url)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             cwd=ROOT)
    try:
        assert watch.stdout is not None
        deadline = time.monotonic() + 30
        while True:
            line = watch.stdout.readline()
            assert line, f"watch ended: {watch.stderr.read() if watch.stderr else ''}"
            rows = {r.get("instance_id") or r["role"]: r for r in json.loads(line)["rows"]}
            mine = rows.get(f"{proc.instance_id:x}")
            if mine and mine.get("inflight") == 0 and rows.get("frontend", {}).get("hit_rate"):
                break
            assert time.monotonic() < deadline, f"no full frame in 30s: {line}"
        # The router matched the second prompt's blocks: 4 of 8 prompt blocks in all.
        assert rows["frontend"]["hit_rate"] == mine["hit_rate"] == "50%", rows
        assert rows["frontend"]["model"] == "tiny" and rows["frontend"]["state"] == "ready"
        assert (mine["role"], mine["model"], mine["kv_usage"]) == ("agg", "tiny", "0%")
        watch.send_signal(signal.SIGTERM)
        assert watch.wait(15) == 0
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait(10)
