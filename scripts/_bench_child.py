"""Child processes for the benchmarks: start, wait for ``READY``, always stop by pid.

Not a benchmark itself. ``Child`` runs ``python <args>`` (this interpreter) with stdout piped
and stderr in a temporary log, waits for the line ``READY <address> <instance id hex>``, and
stops the process with SIGTERM, then SIGKILL after a bound. On Linux the child also gets
SIGTERM if this process dies first (``PR_SET_PDEATHSIG``), so a crashed benchmark leaves no
server behind. Also: the loop runner (uvloop when asked) and small statistics helpers shared by
the ``bench_*.py`` scripts.
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

SCRIPTS = Path(__file__).resolve().parent
#: The benchmarks' own serving process (public runtime API only).
BENCH_SERVER = str(SCRIPTS / "_bench_server.py")
#: The bare pyzmq server the request-plane benchmark compares against.
BARE_SERVER = str(SCRIPTS / "_bare_zmq_server.py")

_PR_SET_PDEATHSIG = 1
_SIGTERM = int(signal.SIGTERM)
# Loaded here, in the parent: after fork only the prctl call itself runs (no dlopen).
_libc: Any = None
if sys.platform == "linux":
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        _libc = None


def _die_with_parent() -> None:
    """In the child, before exec: ask the kernel for SIGTERM when the parent dies."""
    _libc.prctl(_PR_SET_PDEATHSIG, _SIGTERM, 0, 0, 0)


class Child:
    """A child Python process that prints ``READY <address> <instance hex>`` when serving.

    Use as a context manager (or call ``stop`` in a ``finally``): the process is stopped and
    reaped however the block ends.
    """

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None) -> None:
        self._log = tempfile.NamedTemporaryFile(prefix="bench-child-", suffix=".log", delete=False)
        self.popen = subprocess.Popen(
            [sys.executable, *args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, **(env or {})},
            preexec_fn=_die_with_parent if _libc is not None else None,
        )
        self.pid = self.popen.pid
        self.address = ""
        self.instance_id = 0

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
        out = self.popen.stdout
        assert out is not None
        deadline = time.monotonic() + timeout
        buf = b""
        try:
            while time.monotonic() < deadline:
                if self.popen.poll() is not None:
                    raise RuntimeError(f"child exited with {self.popen.returncode}:\n{self.logs()}")
                ready, _, _ = select.select([out], [], [], 0.1)
                if not ready:
                    continue
                chunk = os.read(out.fileno(), 4096)
                buf += chunk
                for line in buf.decode(errors="replace").splitlines():
                    if line.startswith("READY "):
                        parts = line.split()
                        self.address = parts[1]
                        self.instance_id = int(parts[2], 16) if len(parts) > 2 else 0
                        return self
            raise TimeoutError(f"child not ready in {timeout}s:\n{self.logs()}")
        except BaseException:
            self.stop()
            raise

    def logs(self) -> str:
        """The last 5,000 characters of the child's stderr."""
        try:
            return Path(self._log.name).read_text(errors="replace")[-5000:]
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.kill(self.pid, sig)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (after SIGCONT, in case it was stopped), SIGKILL if it has not exited within
        ``timeout``; always reaps it and removes its log. Idempotent."""
        if self.popen.poll() is None:
            for sig in (signal.SIGCONT, signal.SIGTERM):
                try:
                    os.kill(self.pid, sig)
                except ProcessLookupError:
                    break
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.kill(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.popen.wait(timeout)
        if self.popen.stdout is not None and not self.popen.stdout.closed:
            self.popen.stdout.close()
        if not self._log.closed:
            self._log.close()
            Path(self._log.name).unlink(missing_ok=True)


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
