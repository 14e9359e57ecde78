"""Data the tests read, kept in the repository (``tests/data``) so a bare clone has it."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"
#: Real KV-event payloads published by vLLM 0.32 (see its README.md).
VLLM_KV_EVENTS = DATA / "vllm_kv_events" / "sha256_int64"


def vllm_kv_events() -> Path:
    """The directory of vLLM 0.32 KV-event captures; fails loudly if it is empty or missing, so
    no test passes over zero captures."""
    batches = sorted(VLLM_KV_EVENTS.glob("batch_seq*.msgpack"))
    assert batches, f"no vLLM KV-event captures in {VLLM_KV_EVENTS}"
    return VLLM_KV_EVENTS
