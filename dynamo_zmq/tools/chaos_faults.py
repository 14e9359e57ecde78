"""The chaos run's fleet and faults: mocker workers on a ``Cluster``'s hosts, and one fault
every interval on a worker or a worker host (never a frontend's host).

Faults, cycled in ``FAULT_KINDS`` order from a seeded choice of target:

- ``kill``: SIGKILL a worker; start it again (same host, same port) ``restart_after`` seconds
  later, so capacity returns;
- ``stop``: SIGSTOP a worker, SIGCONT it ``down_for`` seconds later;
- ``cut``: take a worker host's link down, bring it back ``down_for`` seconds later;
- ``term``: SIGTERM a worker (graceful shutdown; its unfinished streams hand over); start it
  again once it has exited.

A target is chosen among workers (hosts) no other fault is holding, so faults do not pile up.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from .child_process import ChildProcess
from .netns import Cluster, Host

__all__ = ["FAULT_KINDS", "Fault", "Fleet", "Worker", "inject_faults"]

FAULT_KINDS = ("kill", "stop", "cut", "term")


class Fault(msgspec.Struct):
    """One injected fault: its kind, target (``host`` or ``host/worker``), monotonic start
    and the time it was undone (the worker serving again, the link up; 0: not yet)."""

    kind: str
    target: str
    start: float
    recovered: float = 0.0
    note: str = ""


@dataclass
class Worker:
    """One mocker worker: its host, a fixed port (so a restart reuses it) and its process."""

    host: Host
    name: str
    argv: list[str]
    proc: ChildProcess | None = None
    busy: bool = False  # a fault holds it (or its host)

    def start(self, timeout: float = 60.0) -> None:
        self.proc = self.host.python(*self.argv, timeout=timeout)


@dataclass
class Fleet:
    """The workers of a chaos cluster, by host."""

    cluster: Cluster
    workers: list[Worker] = field(default_factory=list)

    def hosts(self) -> list[Host]:
        seen: dict[str, Host] = {}
        for w in self.workers:
            seen.setdefault(w.host.name, w.host)
        return list(seen.values())

    def on(self, host: Host) -> list[Worker]:
        return [w for w in self.workers if w.host is host]

    async def start_all(self, timeout: float = 120.0) -> None:
        """Start every worker (in parallel threads; each waits for its READY line)."""
        await asyncio.gather(*(asyncio.to_thread(w.start, timeout) for w in self.workers))


async def inject_faults(
    fleet: Fleet,
    *,
    start: float,
    duration: float,
    interval: float,
    kinds: Sequence[str] = FAULT_KINDS,
    seed: int = 0,
    down_for: float = 3.0,
    restart_after: float = 2.0,
    term_wait: float = 30.0,
) -> list[Fault]:
    """Inject one fault every ``interval`` seconds from ``start`` (monotonic) until
    ``start + duration``; returns when every fault is undone (workers restarted, links up)."""
    rng = random.Random(seed)
    faults: list[Fault] = []
    async with asyncio.TaskGroup() as group:
        for n in itertools.count(1):
            at = start + n * interval
            if at >= start + duration:
                break
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            kind = kinds[(n - 1) % len(kinds)]
            fault = await _begin(fleet, kind, rng, down_for, restart_after, term_wait, group)
            if fault is not None:
                faults.append(fault)
    return faults


async def _begin(
    fleet: Fleet, kind: str, rng: random.Random, down_for: float, restart_after: float,
    term_wait: float, group: asyncio.TaskGroup,
) -> Fault | None:
    now = time.monotonic()
    if kind == "cut":
        hosts = [h for h in fleet.hosts() if not any(w.busy for w in fleet.on(h))]
        if not hosts:
            return None
        host = rng.choice(hosts)
        held = fleet.on(host)
        for w in held:
            w.busy = True
        fault = Fault(kind, host.name, now)
        await asyncio.to_thread(fleet.cluster.cut, host)  # ip may be slow on a busy machine
        group.create_task(_heal(fleet, host, held, fault, down_for))
        return fault
    idle = [w for w in fleet.workers if not w.busy and w.proc is not None and w.proc.running()]
    if not idle:
        return None
    worker = rng.choice(idle)
    worker.busy = True
    assert worker.proc is not None
    fault = Fault(kind, f"{worker.host.name}/{worker.name}", now)
    if kind == "kill":
        worker.proc.signal(signal.SIGKILL)
        group.create_task(_restart(worker, fault, restart_after, 0.0))
    elif kind == "stop":
        worker.proc.signal(signal.SIGSTOP)
        group.create_task(_cont(worker, fault, down_for))
    elif kind == "term":
        worker.proc.signal(signal.SIGTERM)
        group.create_task(_restart(worker, fault, 0.0, term_wait))
    else:
        raise ValueError(f"unknown fault kind {kind!r} (known: {', '.join(FAULT_KINDS)})")
    return fault


async def _heal(fleet: Fleet, host: Host, held: list[Worker], fault: Fault, after: float) -> None:
    await asyncio.sleep(after)
    await asyncio.to_thread(fleet.cluster.heal, host)
    fault.recovered = time.monotonic()
    for w in held:
        w.busy = False


async def _cont(worker: Worker, fault: Fault, after: float) -> None:
    await asyncio.sleep(after)
    assert worker.proc is not None
    worker.proc.signal(signal.SIGCONT)
    fault.recovered = time.monotonic()
    worker.busy = False


async def _restart(worker: Worker, fault: Fault, after: float, exit_wait: float) -> None:
    """Wait for the worker's exit (SIGKILL it after ``exit_wait`` seconds), then ``after``
    seconds, then start it again on the same port."""
    proc = worker.proc
    assert proc is not None
    t0 = time.monotonic()
    try:
        code = await asyncio.to_thread(proc.wait, max(exit_wait, 5.0))
    except Exception:
        proc.signal(signal.SIGKILL)
        code = await asyncio.to_thread(proc.wait, 10.0)
        fault.note = f"did not exit within {exit_wait:g}s; killed. "
    if fault.kind == "term":
        fault.note += f"exited {code} after {time.monotonic() - t0:.1f}s. "
    await asyncio.sleep(after)
    try:
        await asyncio.to_thread(worker.start)
    except Exception as exc:  # reported, and the run goes on with less capacity
        fault.note += f"restart failed: {exc}"[:300]
        return
    fault.recovered = time.monotonic()
    worker.busy = False
