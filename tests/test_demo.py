"""``python -m dynamo_zmq demo`` end to end, as a newcomer runs it."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from dynamo_zmq.tools.demo import TEXT
from tests.support.procs import run_cli


def _worker_pid(stdout: str) -> int:
    match = re.search(r"started demo worker pid (\d+)", stdout)
    assert match, stdout
    return int(match.group(1))


def _gone(pid: int) -> bool:
    """True if ``pid`` no longer runs; kills it (by pid) if it still does, so nothing leaks."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    os.kill(pid, signal.SIGKILL)
    return False


@pytest.mark.parametrize("discovery", ["mdns", "static"])
def test_demo_streams_the_text_and_stops_its_worker(discovery) -> None:
    result = run_cli("-m", "dynamo_zmq", "demo", "--discovery", discovery, "--prompt", "hi there")

    assert result.returncode == 0, result.stdout + result.stderr
    assert _gone(_worker_pid(result.stdout))
    words = ["You", "said:", "hi", "there", "--", *TEXT.split()]
    assert " ".join(words) in result.stdout
    summary = re.search(r"(\d+) items, first item after [\d.]+ ms, [\d.]+ items/s", result.stdout)
    assert summary, result.stdout
    assert int(summary.group(1)) == len(words)
    assert re.search(r"stopped demo worker pid \d+ \(exit code 0\)", result.stdout)


def test_worker_only_is_listed_by_status(spawn) -> None:
    worker = spawn("-m", "dynamo_zmq", "demo", "--worker-only")

    result = run_cli("-m", "dynamo_zmq", "status", "--namespace", "demo", "--json", "--wait", "3")

    assert result.returncode == 0, result.stderr
    rows = [r for r in json.loads(result.stdout) if r["instance_id"] == f"{worker.instance_id:x}"]
    assert len(rows) == 1, result.stdout
    assert rows[0]["component"] == "backend"
    assert rows[0]["endpoints"] == ["generate"]
    assert rows[0]["address"] == worker.address


@pytest.mark.parametrize(("flags", "message"), [
    (["--delay", "-1"], "--delay must be a finite number >= 0"),
    (["--timeout", "nan"], "--timeout must be a finite number > 0"),
])
def test_bad_numbers_are_usage_errors(flags, message) -> None:
    result = run_cli("-m", "dynamo_zmq", "demo", *flags)
    assert result.returncode == 2 and message in result.stderr
    assert "started demo worker" not in result.stdout
