"""A child process that says ``READY ...`` on stdout when it serves, for tests and harnesses.

Workers print ``READY <address> <instance id hex>``, frontends ``READY http://HOST:PORT``;
``ChildProcess.wait_ready`` reads that line. Its stderr goes to a log file (``logs()``), and
``stop()`` ends it by pid: SIGCONT (a frozen process cannot act on SIGTERM), SIGTERM, then
SIGKILL after a bounded wait; it always reaps. ``die_with_parent`` (Linux) asks the kernel to
SIGTERM the child if this process dies first (``PR_SET_PDEATHSIG``), so a crashed benchmark
leaves no server behind.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..resources import die_with_parent_hook

__all__ = ["ChildProcess", "die_with_parent_hook"]

class ChildProcess:
    """Start ``argv`` with stdout piped (for the READY line) and stderr to a log file.

    Args:
        argv: the full command line.
        env: the whole environment of the child (``None``: this process's).
        cwd: its working directory (``None``: this process's).
        die_with_parent: SIGTERM the child when this process dies (Linux; ignored elsewhere).
    """

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        die_with_parent: bool = False,
    ) -> None:
        self.argv = list(argv)
        self.log = tempfile.NamedTemporaryFile(prefix="dynzmq-proc-", suffix=".log", delete=False)
        self.popen = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            preexec_fn=die_with_parent_hook() if die_with_parent else None,
        )
        self.pid = self.popen.pid
        #: The first word after READY: a worker's request-plane address, a frontend's URL.
        self.address = ""
        #: The worker's instance id (0 when the READY line has none).
        self.instance_id = 0
        #: Every READY line's address and instance id (several workers in one process).
        self.addresses: list[str] = []
        self.instance_ids: list[int] = []

    def wait_ready(self, timeout: float = 30.0, count: int = 1) -> ChildProcess:
        """Wait for ``count`` ``READY`` lines (a process serving several workers prints one
        each); raises RuntimeError if the process exits first and TimeoutError after
        ``timeout`` seconds (both with the end of its log)."""
        assert self.popen.stdout is not None
        deadline = time.monotonic() + timeout
        buf = b""
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"process exited with {self.popen.returncode}:\n{self.logs()}")
            ready, _, _ = select.select([self.popen.stdout], [], [], 0.1)
            if not ready:
                continue
            buf += os.read(self.popen.stdout.fileno(), 65536)
            lines = [ln.split() for ln in buf.decode(errors="replace").splitlines(keepends=True)
                     if ln.startswith("READY ") and ln.endswith("\n")]
            if len(lines) >= count:
                self.addresses = [parts[1] for parts in lines]
                self.instance_ids = [int(p[2], 16) if len(p) > 2 else 0 for p in lines]
                self.address, self.instance_id = self.addresses[0], self.instance_ids[0]
                return self
        raise TimeoutError(f"process not ready in {timeout}s:\n{self.logs()}")

    def logs(self) -> str:
        """The last 5000 characters of its stderr."""
        return Path(self.log.name).read_text(errors="replace")[-5000:]

    def running(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        """Send ``sig`` if it is still running."""
        if self.popen.poll() is None:
            os.kill(self.pid, sig)

    def wait(self, timeout: float = 20.0) -> int:
        return self.popen.wait(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGCONT and SIGTERM, then SIGKILL if it does not exit in ``timeout`` seconds; always
        reaps and removes its log. Idempotent."""
        if self.popen.poll() is None:
            os.kill(self.pid, signal.SIGCONT)
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.popen.wait(10)
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)
