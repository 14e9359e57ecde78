"""Pieces every command line shares: logging set-up and number checks."""

from __future__ import annotations

import logging
import math
import os
import sys

from ..errors import InvalidArgument

__all__ = ["check_number", "setup_logging"]


def setup_logging() -> None:
    """Log to stderr at ``DYN_LOG`` (default INFO); stdout stays free for ``READY`` lines."""
    logging.basicConfig(
        level=os.environ.get("DYN_LOG", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def check_number(flag: str, value: float, *, positive: bool = False) -> float:
    """``value`` if it is finite and >= 0 (> 0 with ``positive``), else InvalidArgument naming
    ``flag`` (NaN passes every ``<`` test, so a plain comparison would let it through)."""
    if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
        bound = ">" if positive else ">="
        raise InvalidArgument(f"{flag} must be a finite number {bound} 0, got {value}")
    return value
