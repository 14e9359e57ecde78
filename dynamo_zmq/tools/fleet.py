"""A fleet on one machine: many mocker workers and a few kv frontends on namespace hosts.

``Fleet`` builds a ``Cluster`` (``tools.netns``) of ``frontends`` hosts (``f1``...) and
``hosts`` worker hosts (``h1``...), starts a kv frontend with replica sync on each frontend
host and spreads ``workers`` mocker workers over the worker hosts, as worker processes of
``workers_per_process`` workers each (``python -m dynamo_zmq.worker --workers-per-process N``:
every worker its own runtime, sockets, instance id and advert). Nothing is configured for
discovery unless ``worker_args`` / ``frontend_args`` say so: zero flags.

It answers what a fleet run asks: which instances each frontend routes to (its ``/health``),
when every frontend lists a set of workers, when a set has left every frontend's routing;
and it starts, kills and stops worker processes. ``scripts/fleet.py`` runs the measured
phases on it; ``tests/test_fleet.py`` a CI-sized kill.

    with Fleet(FleetConfig(hosts=4, workers=32, frontends=2)) as fleet:
        fleet.start_frontends()
        await fleet.start_workers()
        await fleet.wait_listed(fleet.live_ids(), timeout=60)
"""

from __future__ import annotations

import asyncio
import math
import signal
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from .child_process import ChildProcess
from .host_calls import HTTP_PORT, instances
from .netns import Cluster, Host

__all__ = ["MODEL", "Fleet", "FleetConfig", "WorkerProcess", "spread"]

#: The served model name of every fleet worker.
MODEL = "tiny"


@dataclass
class FleetConfig:
    """What to build. ``workers_per_process`` 0: as few per process as keep the worker
    processes at most ``max_processes``."""

    hosts: int = 8
    workers: int = 32
    frontends: int = 1
    workers_per_process: int = 0
    max_processes: int = 64
    #: The mocker's ``--speedup-ratio``.
    speedup: float = 10.0
    namespace: str = "fleet"
    model_path: str | None = None
    worker_args: Sequence[str] = ()
    frontend_args: Sequence[str] = ("--router-mode", "kv", "--router-replica-sync")
    #: Variables every process gets (``Cluster``'s ``env``), and their working directory.
    env: Mapping[str, str] | None = None
    cwd: str | Path | None = None
    log: Callable[[str], None] = field(default=lambda _msg: None)

    def per_process(self) -> int:
        if self.workers_per_process > 0:
            return self.workers_per_process
        return max(1, math.ceil(self.workers / self.max_processes))


def spread(total: int, bins: int) -> list[int]:
    """``total`` split over ``bins`` as evenly as it goes, larger shares first."""
    return [total // bins + (1 if i < total % bins else 0) for i in range(bins)]


@dataclass
class WorkerProcess:
    """One worker process on a host, serving ``count`` workers."""

    host: Host
    argv: list[str]
    count: int
    proc: ChildProcess | None = None
    #: The instance ids of its workers (from its READY lines).
    ids: list[int] = field(default_factory=list)
    started: float = 0.0
    ready_at: float = 0.0

    def spawn(self) -> None:
        self.started = time.monotonic()
        self.proc = self.host.python(*self.argv, ready=False)

    def wait_ready(self, timeout: float) -> None:
        assert self.proc is not None
        self.proc.wait_ready(timeout, count=self.count)
        self.ready_at = time.monotonic()
        self.ids = list(self.proc.instance_ids)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.running()

    def kill(self) -> None:
        """SIGKILL: its workers vanish without a word (sockets reset, adverts linger)."""
        if self.proc is not None:
            self.proc.signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM and wait: its workers withdraw, drain and exit."""
        if self.proc is not None:
            self.proc.stop(timeout)


class Fleet:
    """Frontends and worker processes on namespace hosts (see the module). A context
    manager: leaving it stops every process and deletes every namespace it made."""

    def __init__(self, cfg: FleetConfig) -> None:
        self.cfg = cfg
        fronts = [f"f{i + 1}" for i in range(cfg.frontends)]
        hosts = [f"h{i + 1}" for i in range(cfg.hosts)]
        self.cluster = Cluster([*fronts, *hosts], env=cfg.env, cwd=cfg.cwd)
        self.frontend_hosts = [self.cluster[n] for n in fronts]
        self.worker_hosts = [self.cluster[n] for n in hosts]
        self.frontends: list[ChildProcess] = []
        self.processes: list[WorkerProcess] = []
        self.model = ""
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def __enter__(self) -> Fleet:
        try:
            self.cluster.start()
            self._tmp = tempfile.TemporaryDirectory(prefix="dzfleet-")
            self.model = self.cfg.model_path or _tiny_model(Path(self._tmp.name) / "model")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop every process (by pid) and delete the namespaces. Idempotent."""
        self.cluster.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # -- processes -------------------------------------------------------------------------

    def worker_argv(self, count: int) -> list[str]:
        cfg = self.cfg
        return ["-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path", self.model,
                "--model-name", MODEL, "--namespace", cfg.namespace,
                "--speedup-ratio", str(cfg.speedup), "--system-port", "-1",
                "--workers-per-process", str(count), *cfg.worker_args]

    def plan(self) -> list[WorkerProcess]:
        """The worker processes of the configured size, spread over the worker hosts (not
        started)."""
        per = self.cfg.per_process()
        counts = spread(self.cfg.workers, len(self.worker_hosts))
        planned = []
        for host, on_host in zip(self.worker_hosts, counts, strict=True):
            for count in spread(on_host, math.ceil(on_host / per)) if on_host else []:
                planned.append(WorkerProcess(host, self.worker_argv(count), count))
        return planned

    def start_frontends(self, timeout: float = 120.0) -> None:
        """Start a frontend on every frontend host and wait until each serves HTTP."""
        procs = [self.start_frontend(host, wait=None) for host in self.frontend_hosts]
        for proc in procs:
            proc.wait_ready(timeout)
        self.frontends.extend(procs)

    def start_frontend(self, host: Host, wait: float | None = 120.0) -> ChildProcess:
        """A frontend on ``host`` (port ``HTTP_PORT``), waited for ``wait`` seconds (None:
        not waited for)."""
        proc = host.python("-m", "dynamo_zmq.frontend", "--http-port", str(HTTP_PORT),
                           "--namespace", self.cfg.namespace, *self.cfg.frontend_args,
                           ready=False)
        return proc if wait is None else proc.wait_ready(wait)

    async def start_workers(
        self, planned: Sequence[WorkerProcess] | None = None, timeout: float = 300.0
    ) -> list[WorkerProcess]:
        """Spawn ``planned`` (default: ``plan()``) at once and wait for every READY line."""
        todo = list(self.plan() if planned is None else planned)
        for wp in todo:
            wp.spawn()
        self.processes.extend(todo)
        await asyncio.gather(*(asyncio.to_thread(wp.wait_ready, timeout) for wp in todo))
        return todo

    def live_ids(self) -> set[int]:
        """The instance ids of every worker whose process runs."""
        return {i for wp in self.processes if wp.alive for i in wp.ids}

    # -- what the frontends route to --------------------------------------------------------

    async def listed(self) -> list[set[int]]:
        """The instance ids each frontend routes the model to now."""
        return list(await asyncio.gather(*(
            asyncio.to_thread(instances, host, MODEL) for host in self.frontend_hosts)))

    async def wait_listed(
        self, expect: set[int], timeout: float, step: float = 0.1
    ) -> list[float]:
        """Seconds until each frontend routes to every id of ``expect`` (it may route to more).

        Raises:
            TimeoutError: some frontend did not within ``timeout`` seconds.
        """
        return await self._wait(lambda seen: expect <= seen, timeout, step, "list every worker")

    async def wait_unlisted(
        self, gone: set[int], timeout: float, step: float = 0.02
    ) -> list[float]:
        """Seconds until each frontend routes to none of ``gone``.

        Raises:
            TimeoutError: some frontend still did after ``timeout`` seconds.
        """
        return await self._wait(lambda seen: not gone & seen, timeout, step, "drop the workers")

    async def _wait(
        self, done: Callable[[set[int]], bool], timeout: float, step: float, what: str
    ) -> list[float]:
        start = time.monotonic()
        took: list[float | None] = [None] * len(self.frontend_hosts)
        while True:
            for i, seen in enumerate(await self.listed()):
                if took[i] is None and done(seen):
                    took[i] = time.monotonic() - start
            if all(t is not None for t in took):
                return [t for t in took if t is not None]
            if time.monotonic() - start > timeout:
                late = [h.name for h, t in zip(self.frontend_hosts, took, strict=True) if t is None]
                raise TimeoutError(f"frontends {', '.join(late)} did not {what} in {timeout:g}s")
            await asyncio.sleep(step)


def _tiny_model(out: Path) -> str:
    from .tiny_model import build_tiny_model

    return str(build_tiny_model(out))
