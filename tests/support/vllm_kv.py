"""The KV-event sockets of a vLLM worker started by a test (its relay's ports, from its log)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.procs import Proc

__all__ = ["kv_ports"]


def kv_ports(worker: Proc) -> tuple[int, int]:
    """The relay's PUB and replay ports, from the worker's log."""
    log = Path(worker.log.name).read_text(errors="replace")
    found = re.search(r"PUB ports \[(\d+)\], replay ports \[(\d+)\]", log)
    assert found, log[-3000:]
    return int(found.group(1)), int(found.group(2))
