"""Pieces every command line shares: logging set-up, number checks, the event loop."""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import os
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

from ..errors import InvalidArgument
from ..tracing import env_flag
from ..tracing._logs import JsonLinesFormatter

__all__ = ["check_number", "run_main", "setup_logging"]

T = TypeVar("T")


def setup_logging() -> None:
    """Log to stderr at ``DYN_LOG`` (default INFO); stdout stays free for ``READY`` lines.
    ``DYN_LOGGING_JSONL=1``: one JSON object per line, with the current span's ``trace_id`` and
    ``span_id`` (``tracing.JsonLinesFormatter``)."""
    logging.basicConfig(
        level=os.environ.get("DYN_LOG", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if env_flag("DYN_LOGGING_JSONL"):
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonLinesFormatter())


def check_number(flag: str, value: float, *, positive: bool = False) -> float:
    """``value`` if it is finite and >= 0 (> 0 with ``positive``), else InvalidArgument naming
    ``flag`` (NaN passes every ``<`` test, so a plain comparison would let it through)."""
    if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
        bound = ">" if positive else ">="
        raise InvalidArgument(f"{flag} must be a finite number {bound} 0, got {value}")
    return value


def run_main(main: Coroutine[Any, Any, T]) -> T:
    """Run a process's main coroutine on uvloop when it is installed (its loop costs about half
    of asyncio's per task wake-up, which a worker pays per token per stream), else on asyncio.
    ``DYN_UVLOOP=0`` forces asyncio.

    What the process made before (its modules, classes, settings: tens of thousands of objects
    that live as long as it does) is first left out of the cyclic garbage collector's full
    collections (``gc.freeze``), which a busy process otherwise runs every few seconds over all
    of them. Only process entry points call this (``gc.freeze`` is process-wide)."""
    gc.collect()
    gc.freeze()
    if os.environ.get("DYN_UVLOOP", "1") != "0":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(main)
    return asyncio.run(main)
