"""A chaos run that must lose nothing (issue 14 item 6; ``scripts/chaos.py`` is its CLI).

A ``Cluster`` (``tools.netns``) gets one or two frontend hosts and ``worker_hosts`` hosts with
``workers_per_host`` mocker workers each, everything found by mDNS with no configuration.
Then, in one invocation:

1. **reference**: every prompt of a seeded pool once, fault-free; the mocker's tokens are a
   function of the prompt, so this is what every later request for that prompt must return;
2. **fault-free**: closed-loop streaming load at ``concurrency`` for ``duration`` seconds;
3. **chaos**: the same load while ``chaos_faults.inject_faults`` injects one fault every
   ``fault_interval`` seconds on a worker or a worker host.

The load runs inside each frontend's host (``tools.chaos_load``). Every request is checked
against the reference (``tools.chaos_report``); migrations come from the frontends' /metrics.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from .chaos_faults import FAULT_KINDS, Fault, Fleet, Worker, inject_faults
from .chaos_load import LoadResult, LoadSpec, Prompt
from .host_calls import HTTP_PORT, get, run_load, wait_instances
from .netns import Cluster, Host

__all__ = ["ChaosConfig", "ChaosResult", "RunResult", "make_prompts", "run_chaos"]

MODEL = "tiny"
WORKER_PORT = 7100
#: Seconds between starting the load processes and the load (their imports take a while).
START_DELAY = 3.0
_WORDS = ("moving house box tape van stairs sofa kitchen plates books lamp garden key door "
          "street map rain friend letter window cat morning train coffee table bed".split())


@dataclass
class ChaosConfig:
    """What to build and run. Times in seconds; ``speedup`` is the mocker's
    ``--speedup-ratio`` (1: the simulated GPU's speed; lower is slower)."""

    worker_hosts: int = 4
    workers_per_host: int = 2
    frontends: int = 1
    concurrency: int = 64
    duration: float = 60.0
    fault_interval: float = 5.0
    faults: tuple[str, ...] = FAULT_KINDS
    seed: int = 0
    speedup: float = 0.1
    pool: int = 128
    min_tokens: int = 32
    max_tokens: int = 128
    request_timeout: float = 30.0
    margin: float = 10.0
    max_requests: int = 100_000
    down_for: float = 3.0
    restart_after: float = 2.0
    graceful_timeout: float = 5.0
    baseline: bool = True
    model_path: str | None = None
    #: A directory to copy every process's whole log (stderr) into at the end.
    logs_dir: str | None = None
    log: Callable[[str], None] = field(default=lambda _msg: None)


class RunResult(msgspec.Struct):
    """One phase: what the load processes saw, the faults, migrations by reason."""

    name: str
    start: float
    duration: float
    loads: list[LoadResult]
    faults: list[Fault] = []
    migrations: dict[str, float] = {}
    #: Busy fraction of the machine's CPUs over the phase (every process, ours or not).
    machine_cpu: float = 0.0


class ChaosResult(msgspec.Struct):
    """Everything a chaos invocation measured (``--json`` saves it)."""

    config: dict[str, object]
    prompts: list[Prompt]
    reference: RunResult
    runs: list[RunResult]
    #: The end of each worker's log and each frontend's whole log, by ``host/name``.
    worker_logs: dict[str, str] = {}


def make_prompts(count: int, min_tokens: int, max_tokens: int, seed: int) -> list[Prompt]:
    """A seeded pool of distinct prompts with token budgets in [min_tokens, max_tokens]."""
    rng = random.Random(seed)
    return [
        Prompt(f"#{i} " + " ".join(rng.choices(_WORDS, k=rng.randint(8, 40))),
               rng.randint(min_tokens, max_tokens))
        for i in range(count)
    ]


def run_chaos(config: ChaosConfig) -> ChaosResult:
    """Build the cluster, run the three phases, tear everything down (see the module)."""
    return asyncio.run(_run(config))


async def _run(cfg: ChaosConfig) -> ChaosResult:
    front_names = [f"fe{i}" for i in range(cfg.frontends)]
    worker_names = [f"w{i}" for i in range(cfg.worker_hosts)]
    prompts = make_prompts(cfg.pool, cfg.min_tokens, cfg.max_tokens, cfg.seed)
    with tempfile.TemporaryDirectory(prefix="dzchaos-") as tmp, \
            Cluster([*front_names, *worker_names]) as cluster:
        model = cfg.model_path or _tiny_model(Path(tmp) / "model")
        fleet = Fleet(cluster)
        for name in worker_names:
            for j in range(cfg.workers_per_host):
                fleet.workers.append(Worker(cluster[name], f"m{j}", _worker_argv(cfg, model, j)))
        cfg.log(f"starting {len(fleet.workers)} workers on {cfg.worker_hosts} hosts, "
                f"{cfg.frontends} frontend(s)")
        fronts = [cluster[n] for n in front_names]
        await asyncio.gather(fleet.start_all(), *(
            asyncio.to_thread(h.python, "-m", "dynamo_zmq.frontend", "--http-port",
                              str(HTTP_PORT), "--request-timeout", str(cfg.request_timeout),
                              "--namespace", "chaos", timeout=120.0)
            for h in fronts))
        for h in fronts:
            await wait_instances(h, MODEL, len(fleet.workers))
        cfg.log("cluster up; reference pass")
        reference = await _phase(cfg, fronts, fleet, prompts, "reference", 0.0, False)
        runs = []
        if cfg.baseline:
            cfg.log(f"fault-free run, {cfg.duration:g}s")
            runs.append(await _phase(cfg, fronts, fleet, prompts, "fault-free", cfg.duration,
                                     False))
        cfg.log(f"chaos run, {cfg.duration:g}s, a fault every {cfg.fault_interval:g}s")
        runs.append(await _phase(cfg, fronts, fleet, prompts, "chaos", cfg.duration, True))
        logs = {f"{w.host.name}/{w.name}": w.proc.logs() for w in fleet.workers if w.proc}
        logs.update({f"{h.name}/frontend": _frontend_logs(cluster, h) for h in fronts})
        if cfg.logs_dir:
            _save_logs(cluster, Path(cfg.logs_dir))
        return ChaosResult(config=_public(cfg), prompts=prompts, reference=reference,
                           runs=runs, worker_logs=logs)


def _worker_argv(cfg: ChaosConfig, model: str, j: int) -> list[str]:
    return ["-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path", model,
            "--model-name", MODEL, "--namespace", "chaos", "--port", str(WORKER_PORT + j),
            "--speedup-ratio", str(cfg.speedup), "--metrics-port", "-1",
            "--graceful-timeout", str(cfg.graceful_timeout)]


async def _phase(cfg: ChaosConfig, fronts: list[Host], fleet: Fleet, prompts: list[Prompt],
                 name: str, duration: float, chaos: bool) -> RunResult:
    before = [await asyncio.to_thread(_migrations, h) for h in fronts]
    start = time.monotonic() + START_DELAY
    n = len(fronts)
    specs = [LoadSpec(url=f"http://127.0.0.1:{HTTP_PORT}", model=MODEL,
                      prompts=prompts[i::n] if duration <= 0 else prompts,
                      concurrency=max(1, cfg.concurrency // n), duration=duration,
                      start_at=start, deadline=cfg.request_timeout, margin=cfg.margin,
                      max_requests=cfg.max_requests // n,
                      offset=0 if duration <= 0 else i, stride=1 if duration <= 0 else n)
             for i in range(n)]
    loads = asyncio.gather(*(asyncio.to_thread(run_load, h, s)
                             for h, s in zip(fronts, specs, strict=True)))
    cpu = asyncio.ensure_future(_busy(start, duration))
    faults: list[Fault] = []
    if chaos:
        inject = inject_faults(fleet, start=start, duration=duration,
                               interval=cfg.fault_interval, kinds=cfg.faults, seed=cfg.seed,
                               down_for=cfg.down_for, restart_after=cfg.restart_after,
                               term_wait=cfg.graceful_timeout + 20.0)
        results, faults = await asyncio.gather(loads, inject)
    else:
        results = await loads
    late = max(r.started for r in results) - start
    if late > 0.5:
        cfg.log(f"{name}: a load process started {late:.1f}s late (a busy machine?)")
    if duration <= 0:  # the reference's prompts were split; put the indexes back
        for i, res in enumerate(results):
            for rec in res.records:
                rec.prompt = rec.prompt * n + i
    for h in fronts:  # every worker back before the next phase (and the metrics read)
        try:
            await wait_instances(h, MODEL, len(fleet.workers))
        except TimeoutError as exc:  # a restart failed: reported by its fault; go on
            cfg.log(f"{name}: {exc}")
    after = [await asyncio.to_thread(_migrations, h) for h in fronts]
    migrations: dict[str, float] = {}
    for b, a in zip(before, after, strict=True):
        for reason, value in a.items():
            migrations[reason] = migrations.get(reason, 0.0) + value - b.get(reason, 0.0)
    return RunResult(name, start, duration, list(results), faults, migrations, await cpu)


async def _busy(start: float, duration: float) -> float:
    """The busy fraction of the machine's CPUs from ``start`` for ``duration`` seconds."""
    await asyncio.sleep(max(0.0, start - time.monotonic()))
    busy0, total0 = _cpu_times()
    await asyncio.sleep(max(1.0, duration))
    busy1, total1 = _cpu_times()
    return (busy1 - busy0) / max(1, total1 - total0)


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _migrations(host: Host) -> dict[str, float]:
    """The frontend's migrations counter by reason."""
    from prometheus_client.parser import text_string_to_metric_families

    _, body = get(host, "/metrics")
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if s.name == "dynamo_frontend_migrations_total" and s.labels.get("model") == MODEL:
                found[s.labels["reason"]] = found.get(s.labels["reason"], 0.0) + s.value
    return found


def _frontend_logs(cluster: Cluster, host: Host) -> str:
    """The whole log of the frontend on ``host`` (a line per migration: small)."""
    for proc in cluster.procs:
        if proc.argv[3] == host.netns and "dynamo_zmq.frontend" in proc.argv:
            return Path(proc.log.name).read_text(errors="replace")
    return ""


def _save_logs(cluster: Cluster, out: Path) -> None:
    """Copy the whole log of every process started in ``cluster`` (restarted ones too)."""
    out.mkdir(parents=True, exist_ok=True)
    names = {h.netns: h.name for h in cluster.hosts.values()}
    for proc in cluster.procs:
        argv = proc.argv
        what = argv[argv.index("-m") + 1].rsplit(".", 1)[-1] if "-m" in argv else "proc"
        host = names.get(argv[3], "x")
        shutil.copyfile(proc.log.name, out / f"{host}-{what}-{proc.pid}.log")


def _tiny_model(out: Path) -> str:
    from .tiny_model import build_tiny_model

    return str(build_tiny_model(out))


def _public(cfg: ChaosConfig) -> dict[str, object]:
    return {k: v for k, v in vars(cfg).items() if k != "log"}
