"""Start real processes for tests and always stop them, by pid."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class Proc:
    """A child Python process that prints ``READY <address> <instance hex>`` when serving."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="dynzmq-proc-", suffix=".log", delete=False)
        full_env = {**os.environ, **(env or {})}
        full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
        self.popen = subprocess.Popen(
            [sys.executable, *args],
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=full_env,
            cwd=ROOT,
        )
        self.pid = self.popen.pid
        self.address = ""
        self.instance_id = 0

    def wait_ready(self, timeout: float = 30.0) -> Proc:
        assert self.popen.stdout is not None
        deadline = time.monotonic() + timeout
        buf = b""
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"process exited with {self.popen.returncode}:\n{self.logs()}")
            ready, _, _ = select.select([self.popen.stdout], [], [], 0.1)
            if not ready:
                continue
            chunk = os.read(self.popen.stdout.fileno(), 4096)
            buf += chunk
            for line in buf.decode(errors="replace").splitlines():
                if line.startswith("READY "):
                    parts = line.split()
                    self.address = parts[1]
                    self.instance_id = int(parts[2], 16) if len(parts) > 2 else 0
                    return self
        raise TimeoutError(f"process not ready in {timeout}s:\n{self.logs()}")

    def logs(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-5000:]

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.kill(self.pid, sig)

    def wait(self, timeout: float = 20.0) -> int:
        return self.popen.wait(timeout)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not exit in 10 s; always reaps."""
        if self.popen.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.popen.wait(10)
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)
