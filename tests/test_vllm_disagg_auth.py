"""Disaggregated prefill/decode between vLLM workers with ``--auth-keys``: the KV connector's
sockets are CURVE (the prefill worker's public key travels in the handoff), the decode worker
pulls the blocks and the greedy output equals the aggregated output. The client runs in a
process of its own (tests/support/disagg_client.py): CURVE, once on, is on for a whole process.

Runs only where vLLM is installed (skipped otherwise, failed in CI: see tests/test_vllm.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import tests.support.needs_vllm  # noqa: F401  (skips this module without vLLM; fails it in CI)

# isort: split

from dynamo_zmq.tools.keys import authorize, create_keypair, load_keypair
from tests.support.procs import ROOT, Proc, pythonpath
from tests.support.vllm_stack import VLLM_ENV, WORKER_FLAGS, WORKER_START

pytestmark = [pytest.mark.timeout(900)]

PROMPT = [(i * 41) % 240 + 6 for i in range(2 * 32 + 17)]


def test_disaggregated_serving_with_auth_keys(tiny_model, tmp_path: Path):
    keydir = tmp_path / "keys"
    for name in ("prefill", "decode", "client"):
        create_keypair(keydir, name)
        authorize(keydir, str(keydir / f"{name}.key"))
    procs: dict[str, tuple[str, Proc]] = {}
    try:
        for role in ("prefill", "decode"):
            ns = f"t{uuid.uuid4().hex[:12]}"
            procs[role] = (ns, Proc(
                ["-m", "dynamo_zmq.worker", "--engine", "vllm", "--model-path", str(tiny_model),
                 "--model-name", "tiny", "--namespace", ns, "--host", "127.0.0.1",
                 "--disaggregation-mode", role, "--auth-keys", str(keydir), "--auth-key-name",
                 role, *WORKER_FLAGS], env=VLLM_ENV))
        for _, proc in procs.values():
            proc.wait_ready(WORKER_START)
        done = subprocess.run(
            [sys.executable, "-m", "tests.support.disagg_client", procs["prefill"][0],
             procs["decode"][0], str(keydir), "client", json.dumps(PROMPT), "20"],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": pythonpath(None)},
            capture_output=True, text=True, timeout=400, check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        out = json.loads(done.stdout.strip().splitlines()[-1])
        public = load_keypair(keydir, "prefill")[0].decode()
        assert out["handoff"]["curve_key"] == public, out["handoff"]
        assert len(out["reference"]) == 20
        assert out["tokens"] == out["reference"]
        logs = procs["decode"][1].logs()
        assert re.search(r"pulled 3 blocks \(\d+ bytes\)", logs), logs[-3000:]
        assert "prefilling it locally" not in logs
    finally:
        for _, proc in procs.values():
            proc.stop()
