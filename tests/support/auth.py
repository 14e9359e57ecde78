"""Helpers for CURVE auth tests through real processes: the real keys CLI, mocker workers
started with ``--auth-keys``, their logs, and calls to a frontend over such workers."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tests.support.http_calls import get
from tests.support.mocker_fleet import start_mocker
from tests.support.procs import ROOT, Proc

__all__ = ["BLOCK", "complete", "health_models", "keys_cli", "log_of", "worker"]

#: The ``--block-size`` of every ``worker``.
BLOCK = 16


def keys_cli(*args: str) -> str:
    """``python -m dynamo_zmq.keys ARGS`` (the real CLI); its stdout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", "dynamo_zmq.keys", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip()


def worker(spawn: Callable[..., Proc], namespace: str, model: Path, keydir: Path | None,
           name: str = "", *extra: str) -> Proc:
    """A mocker worker (block size ``BLOCK``) with ``--auth-keys keydir --auth-key-name name``,
    or without auth when ``keydir`` is None."""
    auth = ["--auth-keys", str(keydir), "--auth-key-name", name] if keydir else []
    return start_mocker(spawn, namespace, model, "--block-size", str(BLOCK), *auth, *extra)


def log_of(proc: Proc) -> str:
    """Everything ``proc`` has logged so far."""
    return Path(proc.log.name).read_text(errors="replace")


def complete(url: str, tokens: list[int]) -> str:
    """POST a token-id completion; the ``x-dynamo-worker`` instance that served it."""
    body = json.dumps({"model": "tiny", "prompt": tokens, "max_tokens": 3}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
        return resp.headers["x-dynamo-worker"].split("/")[0]


async def health_models(url: str) -> dict:
    """The ``models`` of the frontend's ``/health`` (on 200 or 503); empty on any other status."""
    status, body = await asyncio.to_thread(get, f"{url}/health")
    return json.loads(body).get("models", {}) if status in (200, 503) else {}
