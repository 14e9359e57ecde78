"""The soak (``scripts/soak.py``): a frontend (kv mode), a standalone KV router and mocker
workers under steady load for a long time, each process's memory and open fds sampled.

All on loopback (mDNS pinned to 127.0.0.1), in a namespace of the run's own. The frontend and
``python -m router`` both run with ``--router-replica-sync``, so the router indexes the same KV
events and counts the frontend's load. ``concurrency`` loops send streaming chats: a system
prompt from a pool (shared prefixes, so the KV index fills, matches and evicts) and a user
message of random words; a ``disconnect_fraction`` of them close the stream after the first
chunk. Every ``restart_interval`` seconds the last worker is stopped (SIGTERM: it hands its
streams over) and a new one started in its place. Every ``sample_interval`` seconds the RSS
(``VmRSS``) and open fds (``/proc/PID/fd``) of each process, and each router's KV index size
(``dynamo_router_kv_index_blocks``), are recorded. ``soak_report`` judges the series.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import msgspec

from .child_process import ChildProcess
from .soak_report import ProcessSeries, SoakResult

__all__ = ["SoakConfig", "run_soak"]

_MODEL = "tiny"


class SoakConfig(msgspec.Struct, frozen=True):
    """One soak run (``scripts/soak.py`` has the flags)."""

    minutes: float = 30.0
    workers: int = 4
    concurrency: int = 8
    sample_interval: float = 10.0
    restart_interval: float = 60.0
    disconnect_fraction: float = 0.1
    pool: int = 200
    max_tokens: int = 48
    speedup: float = 2.0
    num_gpu_blocks: int = 1024
    seed: int = 0
    model_path: str | None = None


def run_soak(cfg: SoakConfig) -> SoakResult:
    """Run the soak and return what it measured (the processes are always stopped)."""
    return asyncio.run(_Soak(cfg).run())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _rss_mb(pid: int) -> float:
    """Resident MB of ``pid``.

    Raises:
        ProcessLookupError: no such process, or one that has exited but is not yet reaped (a
            zombie's status has no ``VmRSS``): a worker between incarnations, not a 0 MB one.
    """
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ProcessLookupError(pid)


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return str(resp.read().decode())


def _index_blocks(metrics: str) -> float:
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith("dynamo_router_kv_index_blocks{") and f'model="{_MODEL}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


class _Soak:
    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.namespace = f"soak-{uuid.uuid4().hex[:8]}"
        self.env = {**os.environ, "DYN_MDNS_INTERFACES": "127.0.0.1", "PYTHONUNBUFFERED": "1"}
        self.result = SoakResult(minutes=cfg.minutes)
        self.workers: list[ChildProcess] = []
        self.procs: list[ChildProcess] = []
        self.series: dict[str, ProcessSeries] = {}
        self.front: ChildProcess | None = None
        self.router: ChildProcess | None = None
        self.words = [f"w{i}" for i in range(500)]
        self.prefixes = [" ".join(self.rng.choices(self.words, k=self.rng.randint(40, 160)))
                         for _ in range(cfg.pool)]

    # -- processes -------------------------------------------------------------------------

    def _start(self, *args: str) -> ChildProcess:
        proc = ChildProcess([sys.executable, *args], env=self.env, die_with_parent=True)
        self.procs.append(proc)
        return proc

    def _worker(self, model: str) -> ChildProcess:
        c = self.cfg
        return self._start(
            "-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path", model,
            "--model-name", _MODEL, "--namespace", self.namespace, "--host", "127.0.0.1",
            "--speedup-ratio", f"{c.speedup:g}", "--num-gpu-blocks-override",
            str(c.num_gpu_blocks),
        )

    async def _up(self, model: str) -> tuple[str, str]:
        """Start everything; the frontend's URL and the router's metrics URL."""
        self.workers = [self._worker(model) for _ in range(self.cfg.workers)]
        front = self._start("-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace",
                            self.namespace, "--router-mode", "kv", "--router-replica-sync")
        router_port = _free_port()
        router = self._start("-m", "router", "--namespace", self.namespace,
                             "--router-replica-sync", "--host", "127.0.0.1",
                             "--metrics-port", str(router_port))
        for p in [*self.workers, front, router]:
            await asyncio.to_thread(p.wait_ready, 60.0)
        url = front.address
        await self._listed(url, {w.instance_id for w in self.workers})
        self.series = {
            "frontend": ProcessSeries("frontend"), "router": ProcessSeries("router"),
            **{f"worker{i}": ProcessSeries(f"worker{i}") for i in range(self.cfg.workers)},
        }
        # the last worker is restarted during the run: reported, not judged
        self.series[f"worker{self.cfg.workers - 1}"].judged = False
        self.front, self.router = front, router
        return url, f"http://127.0.0.1:{router_port}"

    async def _listed(self, url: str, ids: set[int], timeout: float = 60.0) -> None:
        """Wait until the frontend's ``/health`` lists exactly the workers ``ids``."""
        want = {f"{i:x}" for i in ids}
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError, ValueError):
                body = json.loads(await asyncio.to_thread(_get, f"{url}/health"))
                if set(body["models"].get(_MODEL, [])) == want:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the frontend never listed workers {sorted(want)}")
            await asyncio.sleep(0.5)

    def _down(self) -> None:
        for p in reversed(self.procs):
            p.stop()

    # -- load ------------------------------------------------------------------------------

    async def _request(self, client: Any) -> None:
        r = self.result
        rng = self.rng
        messages = [
            {"role": "system", "content": self.prefixes[int(rng.paretovariate(1.2)) % len(
                self.prefixes)]},
            {"role": "user", "content": " ".join(rng.choices(self.words, k=rng.randint(5, 60)))},
        ]
        disconnect = rng.random() < self.cfg.disconnect_fraction
        r.requests += 1
        try:
            stream = await client.chat.completions.create(
                model=_MODEL, messages=messages, stream=True,
                max_tokens=rng.randint(1, self.cfg.max_tokens),
            )
            async for _chunk in stream:
                if disconnect:
                    await stream.close()
                    r.disconnects += 1
                    return
            r.ok += 1
        except Exception as exc:  # every failure is counted and judged, none ends the loop
            r.errors += 1
            if len(r.first_errors) < 10:
                r.first_errors.append(f"{type(exc).__name__}: {exc}"[:300])

    async def _load(self, url: str, until: float) -> None:
        import openai

        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="soak", max_retries=0,
                                      timeout=60.0) as client:

            async def loop() -> None:
                while time.monotonic() < until:
                    await self._request(client)

            await asyncio.gather(*(loop() for _ in range(self.cfg.concurrency)))

    async def _restarts(self, model: str, url: str, until: float) -> None:
        slot = self.cfg.workers - 1
        while time.monotonic() + self.cfg.restart_interval < until:
            await asyncio.sleep(self.cfg.restart_interval)
            old = self.workers[slot]
            await asyncio.to_thread(old.stop, 30.0)
            self.procs.remove(old)
            new = self._worker(model)
            await asyncio.to_thread(new.wait_ready, 60.0)
            self.workers[slot] = new
            self.result.restarts += 1
            await self._listed(url, {w.instance_id for w in self.workers})

    # -- sampling --------------------------------------------------------------------------

    async def _sample(self, url: str, router_url: str, start: float, until: float) -> None:
        index = self.result.kv_index
        index["frontend"], index["router"] = [], []
        assert self.front is not None and self.router is not None
        while True:
            t = time.monotonic() - start
            pids = {"frontend": self.front.pid, "router": self.router.pid,
                    **{f"worker{i}": w.pid for i, w in enumerate(self.workers)}}
            for name, pid in pids.items():
                with contextlib.suppress(OSError):  # a worker between incarnations
                    s = self.series[name]
                    rss, fds = _rss_mb(pid), _fds(pid)
                    s.t.append(t)
                    s.rss_mb.append(rss)
                    s.fds.append(fds)
            for name, metrics_url in (("frontend", url), ("router", router_url)):
                with contextlib.suppress(OSError, ValueError):
                    page = await asyncio.to_thread(_get, f"{metrics_url}/metrics")
                    index[name].append(_index_blocks(page))
            if time.monotonic() + self.cfg.sample_interval > until:
                return
            await asyncio.sleep(self.cfg.sample_interval)

    # -- the run ---------------------------------------------------------------------------

    async def run(self) -> SoakResult:
        cfg = self.cfg
        with tempfile.TemporaryDirectory(prefix="soak-model-") as tmp:
            model = cfg.model_path or _tiny_model(Path(tmp) / "tiny")
            try:
                url, router_url = await self._up(model)
                start = time.monotonic()
                until = start + cfg.minutes * 60
                await asyncio.gather(
                    self._load(url, until),
                    self._restarts(model, url, until),
                    self._sample(url, router_url, start, until),
                )
            finally:
                await asyncio.to_thread(self._down)
        self.result.processes = list(self.series.values())
        return self.result


def _tiny_model(out: Path) -> str:
    from .tiny_model import build_tiny_model

    return str(build_tiny_model(out))
