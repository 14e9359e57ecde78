"""The README's main command: frontend + mocker on a tiny local model, and a curl that works."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from tests.support.procs import ROOT


def test_quickstart_serves_and_answers(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "dynamo_zmq", "quickstart", "--check", "--http-port", "0",
         "--model-dir", str(tmp_path / "model")],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    curl = re.search(r"curl -s (http://\S+)/v1/chat/completions .* -d '(.*)'", res.stdout)
    assert curl, res.stdout
    assert json.loads(curl.group(2))["model"] == "tiny-llama"
    answer = json.loads(res.stdout[res.stdout.index("{\n"):])
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 16


def test_a_port_in_use_is_one_clear_error_and_stops_the_worker(tmp_path, taken_port):
    port = taken_port
    res = subprocess.run(
        [sys.executable, "-m", "dynamo_zmq", "quickstart", "--http-port", str(port),
         "--model-dir", str(tmp_path / "model")],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
    )
    assert res.returncode == 1, res.stderr[-3000:]
    assert (
        f"cannot serve HTTP on 127.0.0.1:{port}" in res.stderr
        and "frontend exited with 1" in res.stderr
    )
    assert "Traceback" not in res.stderr and "worker stopped" in res.stderr
