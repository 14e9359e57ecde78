"""Every command the README and docs/operations.md tell a user to run starts and answers
``--help`` (a moved module breaks a documented command before anything else)."""

from __future__ import annotations

import subprocess
import sys

import pytest

COMMANDS = [
    ["-m", "dynamo_zmq.worker"],
    ["-m", "dynamo_zmq.worker", "--engine", "mocker"],
    ["-m", "dynamo_zmq.frontend"],
    ["-m", "dynamo_zmq.quickstart"],
    ["-m", "dynamo_zmq.status"],
    ["-m", "dynamo_zmq.demo"],
    ["-m", "dynamo_zmq", "status"],
    ["-m", "dynamo_zmq", "tiny-model"],
    ["-m", "dynamo_zmq", "tiny-lora"],
    ["-m", "dynamo_zmq", "tiny-vlm"],
    ["-m", "router"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_documented_command_answers_help(command: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, *command, "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout.lower(), done.stdout[:500]
