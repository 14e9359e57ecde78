"""Child processes for the benchmarks: start, wait for ``READY``, always stop by pid.

Not a benchmark itself. ``Child`` is the package's ``ChildProcess`` (READY wait, log, stop by
pid) running ``python <args>`` with this interpreter, as a context manager, dying with this
process (``PR_SET_PDEATHSIG`` on Linux), so a crashed benchmark leaves no server behind. Also:
the loop runner (uvloop when asked) and small statistics helpers shared by the ``bench_*.py``
scripts.
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

from dynamo_zmq.tools.child_process import ChildProcess

SCRIPTS = Path(__file__).resolve().parent
#: The benchmarks' own serving process (public runtime API only).
BENCH_SERVER = str(SCRIPTS / "_bench_server.py")
#: The bare pyzmq server the request-plane benchmark compares against.
BARE_SERVER = str(SCRIPTS / "_bare_zmq_server.py")


class Child(ChildProcess):
    """A child Python process that prints ``READY <address> <instance hex>`` when serving, and
    dies with this one.

    Use as a context manager (or call ``stop`` in a ``finally``): the process is stopped and
    reaped however the block ends.
    """

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None) -> None:
        super().__init__([sys.executable, *args], env={**os.environ, **(env or {})},
                         die_with_parent=True)

    def __enter__(self) -> Child:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def process(self) -> psutil.Process:
        """For CPU accounting."""
        return psutil.Process(self.pid)

    def wait_ready(self, timeout: float = 30.0) -> Child:
        """Wait for the READY line; raises (after stopping the child) if it does not come."""
        try:
            super().wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self


def run(main: Coroutine[Any, Any, None], use_uvloop: bool) -> None:
    """Run ``main`` on uvloop when asked and installed, else on the stdlib loop."""
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            uvloop.run(main)
            return
    asyncio.run(main)


def cpu_seconds(process: psutil.Process) -> float:
    """User + system CPU seconds used so far by ``process``."""
    t = process.cpu_times()
    return float(t.user + t.system)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0-100) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    print("a helper module of the bench_*.py scripts: nothing to run on its own")
