"""Shared data the tests read: the real vLLM KV-event captures in ``shared/`` beside the repo."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.procs import ROOT

SHARED = Path(os.environ.get("DYN_SHARED_DIR") or ROOT.parent / "shared")


def vllm_kv_events() -> Path:
    """The directory of vLLM 0.32 KV-event captures; a missing one fails the test (never skips)."""
    path = SHARED / "fixtures" / "vllm_kv_events" / "sha256_int64"
    if not path.is_dir():
        pytest.fail(
            f"the vLLM KV-event captures are missing at {path}: the project expects shared/ beside "
            "the repository (as CI has it), or DYN_SHARED_DIR pointing at it",
            pytrace=False,
        )
    return path
