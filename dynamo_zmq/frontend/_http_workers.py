"""``--http-workers N``: N frontend processes serve one HTTP port together (``SO_REUSEPORT``).

With N > 1 the process the user started becomes a small supervisor (``supervise``): it holds
the port (an ``SO_REUSEPORT`` socket bound but never listening, so it takes no connection and
``--http-port 0`` resolves once), starts N children (``python -m dynamo_zmq.frontend`` with the
same arguments, ``--http-workers 1`` and that port), and prints ``READY http://HOST:PORT``
once every child has. The kernel spreads new connections over the children's listening
sockets. Each child routes on its own; in a plugin router mode (``kv``, ``approx``) they get
``--router-replica-sync``, so each counts its siblings' requests in flight, and with static
discovery alone also a private directory (``--discovery static,dir``) in which they find each
other. The supervisor forwards SIGTERM/SIGINT to every child (each drains with its own
``--graceful-timeout``) and exits when they have; a child that exits otherwise is restarted
after a backoff while the others serve. Children run in their own process group (a terminal's
Ctrl-C reaches them once, through the supervisor) and get SIGTERM from the kernel if the
supervisor dies (``PR_SET_PDEATHSIG``).

A child learns its place from ``WORKER_ENV`` (``WorkerSlot``): its index, the count and the
supervisor's directory, where ``_sibling_metrics.py`` keeps each child's metrics socket.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..discovery import DiscoveryConfig
from ..llm import BUILTIN_MODES
from ..resources import die_with_parent_hook

__all__ = ["WORKER_ENV", "WorkerSlot", "reuseport_socket", "supervise"]

log = logging.getLogger("dynamo_zmq.frontend.http_workers")

#: Set by the supervisor in each child: ``INDEX:COUNT:DIRECTORY``.
WORKER_ENV = "_DYN_HTTP_WORKER"
#: Seconds before the first restart of a child, and the longest wait (doubling in between).
RESTART_FIRST, RESTART_MAX = 1.0, 30.0
#: A child that served this many seconds before it exited is restarted after ``RESTART_FIRST``.
STABLE_AFTER = 60.0
#: Seconds a (re)started child may take to say READY before it is killed and started again.
READY_TIMEOUT = 120.0


@dataclass(frozen=True)
class WorkerSlot:
    """One child's place among the supervisor's ``count``."""

    index: int
    count: int
    directory: Path
    #: The supervisor's pid (this process's parent when it started).
    supervisor: int = 0

    @classmethod
    def from_env(cls) -> WorkerSlot | None:
        """This process's slot (None: not started by a supervisor)."""
        value = os.environ.get(WORKER_ENV)
        if not value:
            return None
        index, count, directory = value.split(":", 2)
        return cls(int(index), int(count), Path(directory), os.getppid())

    def remove_if_orphaned(self) -> None:
        """Remove the supervisor's directory if the supervisor is gone (killed: it could not)."""
        if os.getppid() != self.supervisor:
            shutil.rmtree(self.directory, ignore_errors=True)

    def env_value(self) -> str:
        return f"{self.index}:{self.count}:{self.directory}"

    def metrics_socket(self, index: int) -> Path:
        """The Unix socket child ``index`` answers its metrics on (``_sibling_metrics.py``)."""
        return self.directory / f"metrics-{index}.sock"


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEPORT`` (not listening yet).

    Raises:
        OSError: the address cannot be resolved or bound (taken by a socket without
            ``SO_REUSEPORT``, or another user's).
    """
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
    except BaseException:
        sock.close()
        raise
    return sock


def child_args(argv: Sequence[str], args: argparse.Namespace, port: int,
               directory: Path) -> list[str]:
    """A child's command line: the user's arguments, then what makes it one of the group."""
    out = [sys.executable, "-m", "dynamo_zmq.frontend", *argv,
           "--http-workers", "1", "--http-port", str(port)]
    if args.router_mode not in BUILTIN_MODES and hasattr(args, "router_replica_sync"):
        out.append("--router-replica-sync")
        backends = DiscoveryConfig.from_args(args).backends
        if "mdns" not in backends and "dir" not in backends:  # static alone: no way to meet
            out += ["--discovery", f"{args.discovery},dir",
                    "--discovery-dir", str(directory / "discovery")]
    return out


class _Child:
    """One slot's process, started again after it exits (until the group stops)."""

    def __init__(self, slot: WorkerSlot, argv: list[str]) -> None:
        self.slot, self._argv = slot, argv
        self.proc: asyncio.subprocess.Process | None = None
        self.url = ""

    async def start(self) -> bool:
        """Start the process and wait for its READY line; False if it exited (or hung) first."""
        env = {**os.environ, WORKER_ENV: self.slot.env_value()}
        self.proc = proc = await asyncio.create_subprocess_exec(
            *self._argv, stdout=asyncio.subprocess.PIPE, env=env,
            preexec_fn=die_with_parent_hook(), process_group=0,
        )
        assert proc.stdout is not None
        try:
            async with asyncio.timeout(READY_TIMEOUT):
                while line := await proc.stdout.readline():
                    if line.startswith(b"READY "):
                        self.url = line.split()[1].decode()
                        log.info("http worker %d (pid %d) serves %s", self.slot.index, proc.pid,
                                 self.url)
                        return True
                    _echo(line)
        except TimeoutError:
            log.error("http worker %d (pid %d) not ready in %gs: killing it", self.slot.index,
                      proc.pid, READY_TIMEOUT)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        await proc.wait()
        return False

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    async def wait(self) -> int:
        """The process's exit status, once it has exited (its stdout read to the end)."""
        assert self.proc is not None and self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            _echo(line)
        return await self.proc.wait()


def _echo(line: bytes) -> None:
    """Pass on a line a child printed (a frontend prints only READY there)."""
    sys.stdout.buffer.write(line)
    sys.stdout.flush()


class _Group:
    def __init__(self, children: list[_Child]) -> None:
        self.children = children
        self.stopping = asyncio.Event()

    def on_signal(self, sig: int) -> None:
        if not self.stopping.is_set():
            log.info("signal %s: stopping %d http workers", signal.Signals(sig).name,
                     len(self.children))
        self.stopping.set()
        for child in self.children:  # a second signal reaches them too: no more grace
            child.signal(sig)

    async def keep(self, child: _Child) -> int:
        """Keep ``child`` running until the group stops; its last exit status."""
        backoff, started = RESTART_FIRST, time.monotonic()
        while True:
            rc = await child.wait()
            if self.stopping.is_set():
                return rc
            pid = child.proc.pid if child.proc else 0
            if time.monotonic() - started >= STABLE_AFTER:
                backoff = RESTART_FIRST
            log.warning("http worker %d (pid %d) exited with status %d: restarting it in %gs",
                        child.slot.index, pid, rc, backoff)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), backoff)
            if self.stopping.is_set():
                return 0
            backoff, started = min(backoff * 2, RESTART_MAX), time.monotonic()
            if not await child.start():
                log.warning("http worker %d exited before it was ready", child.slot.index)
            elif self.stopping.is_set():  # the signal came while it started: it missed it
                child.signal(signal.SIGTERM)


async def _supervise(argv: Sequence[str], args: argparse.Namespace, port: int,
                     directory: Path) -> int:
    count = args.http_workers
    command = child_args(argv, args, port, directory)
    group = _Group([_Child(WorkerSlot(i, count, directory), command) for i in range(count)])
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, group.on_signal, sig)
    ready = await asyncio.gather(*(child.start() for child in group.children))
    if not all(ready) or group.stopping.is_set():
        asked = group.stopping.is_set()  # a signal while they started
        if not asked:
            log.error("http workers %s exited before they were ready: stopping the others",
                      [c.slot.index for c, ok in zip(group.children, ready, strict=True)
                       if not ok])
        group.on_signal(signal.SIGTERM)  # (again: one started as the signal came missed it)
        codes = await asyncio.gather(*(c.wait() for c in group.children if c.proc is not None))
        return 0 if asked and not any(codes) else 1
    print(f"READY {group.children[0].url}", flush=True)
    codes = await asyncio.gather(*(group.keep(child) for child in group.children))
    return 0 if not any(codes) else 1


def supervise(argv: Sequence[str], args: argparse.Namespace) -> int:
    """Serve ``args.http_port`` with ``args.http_workers`` children (see the module doc);
    returns the exit status: 0 once every child has drained after a signal.

    Args:
        argv: the command line the user gave (the children get it too).
        args: it parsed (and checked).
    """
    try:
        held = reuseport_socket(args.http_host, args.http_port)
    except OSError as exc:
        print(f"error: cannot serve HTTP on {args.http_host}:{args.http_port}: {exc}",
              file=sys.stderr)
        return 1
    directory = Path(tempfile.mkdtemp(prefix="dynzmq-http-"))
    try:
        with held:
            return asyncio.run(_supervise(argv, args, held.getsockname()[1], directory))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
