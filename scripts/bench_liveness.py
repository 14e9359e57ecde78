"""How fast a dead, frozen or stuck instance stops being routed to, and what watching costs.

    python scripts/bench_liveness.py [--trials 20] [--discovery mdns|static]
        [--cases kill,stop,stuck] [--max-seconds 30]
    python scripts/bench_liveness.py --idle-peers 256,512 [--idle-seconds 20] [--idle-runs 3]
        [--servers 8]

Trials (each bounded by ``--max-seconds``; every child process is always stopped):

- ``kill`` / ``stop``: one of two server processes (``scripts/_bench_server.py``) streams to
  this process; after a random part of a ping interval it is SIGKILLed (its TCP connections
  reset) or SIGSTOPped (silent, like a hung host). Timed from the signal: (a) the open stream
  ending with ``Disconnected`` and (b) the instance leaving the client's routing set (a frozen
  instance is routed to while no other answers, hence the second server).
- ``stuck``: a mocker worker process (``python -m dynamo_zmq.worker``, engine
  ``_bench_stuck_mocker.py``) streams two requests to this process; after a random wait its
  engine is made to stop producing (SIGUSR1: the process, its loop and its pings live on).
  Timed from then: the instance leaving the client's routing set (its health canary withdraws
  the generate endpoint). Then the engine is started again, and the instance comes back.
  Its streams are the frontend's stall timeout's (``--stream-stall-timeout``), not timed here.

``--idle-peers``: this process keeps N idle connections (a ``PingTicker`` shared by them, as a
frontend's ``PeerPool`` has) to ``--servers`` server processes, and measures its own CPU for
``--idle-seconds``, with the answer check (``ANSWER_TIMEOUT``, the SILENT state) and without
it (pings only, as before), ``--idle-runs`` times each, alternating which goes first: the same
pings and pongs go out either way.

mDNS is pinned to loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import tempfile
import time
import uuid
from collections.abc import AsyncIterator

import psutil
from _bench_child import BENCH_SERVER, SCRIPTS, Child, cpu_seconds, percentile

from dynamo_zmq import errors
from dynamo_zmq.discovery import DiscoveryConfig
from dynamo_zmq.resources import Resources
from dynamo_zmq.runtime import Client, DistributedRuntime, RuntimeConfig
from dynamo_zmq.transport import PeerConnection, PingTicker
from dynamo_zmq.transport._peer_liveness import ANSWER_TIMEOUT, PING_INTERVAL

os.environ.setdefault("DYN_MDNS_INTERFACES", "127.0.0.1")

#: The stuck trials' requests: long streams of the tiny model, never ending on their own.
STREAM = {"token_ids": list(range(10, 42)), "stop": {"max_tokens": 1900, "ignore_eos": True}}


def runtime_for(discovery: str, *addresses: str) -> DistributedRuntime:
    if discovery == "static":
        disc = DiscoveryConfig(backend="static", static_addresses=addresses)
    else:
        disc = DiscoveryConfig(backend="mdns", mdns_interfaces=("127.0.0.1",))
    return DistributedRuntime(config=RuntimeConfig(discovery=disc, host="127.0.0.1"))


async def until_routed(rt: DistributedRuntime, client: Client, iid: int, routed: bool,
                       t0: float, max_seconds: float) -> float:
    """Seconds from ``t0`` until ``iid`` is (or is no longer) in ``client``'s routing set."""
    while (iid in client.instance_ids()) != routed:
        if time.perf_counter() - t0 > max_seconds:
            state = "routed" if not routed else "not routed"
            raise TimeoutError(f"instance still {state} after {max_seconds}s")
        await rt.wait_peers_changed(0.05)
    return time.perf_counter() - t0


async def trial(sig: int, discovery: str, max_seconds: float) -> tuple[float, float]:
    """Two servers, one stream from the first, one signal to it; returns (stream fails, out of
    routing) in seconds. (A frozen instance is routed to while no other answers: hence two.)"""
    ns = f"bench{uuid.uuid4().hex[:8]}"
    args = [BENCH_SERVER, "--namespace", ns, "--host", "127.0.0.1", "--discovery", discovery]
    with Child(args) as proc, Child(args) as other:
        proc.wait_ready()
        other.wait_ready()
        rt = runtime_for(discovery, proc.address, other.address)
        try:
            client = await rt.endpoint(f"{ns}.backend.count").client()
            for iid in (proc.instance_id, other.instance_id):
                await until_routed(rt, client, iid, True, time.perf_counter(), max_seconds)
            stream = await client.direct({"n": 10_000_000, "delay": 0.002}, proc.instance_id)
            await stream.__anext__()
            await asyncio.sleep(random.uniform(0, PING_INTERVAL))  # any phase of the pings
            t0 = time.perf_counter()
            proc.signal(sig)
            task = asyncio.create_task(drain(stream, t0))
            try:
                gone = await until_routed(rt, client, proc.instance_id, False, t0, max_seconds)
                stream_end = await asyncio.wait_for(task, max_seconds)
            finally:
                task.cancel()
            return stream_end, gone
        finally:
            await rt.close()


async def drain(stream: AsyncIterator[object], t0: float) -> float:
    """Read until the stream fails with Disconnected; seconds since ``t0``."""
    try:
        async for _ in stream:
            pass
    except errors.Disconnected:
        return time.perf_counter() - t0
    raise AssertionError("stream ended without Disconnected")


async def read_quietly(stream: AsyncIterator[object]) -> None:
    """Read a stream until it ends, whichever way."""
    try:
        async for _ in stream:
            pass
    except errors.DynamoError:
        pass


async def stuck_trials(trials: int, discovery: str, max_seconds: float) -> list[float]:
    """One mocker worker; per trial its engine stops producing under two streams; returns the
    seconds until it was out of routing, per trial."""
    from dynamo_zmq.tools.tiny_model import build_tiny_model

    ns = f"bench{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(f"{tmp}/model")
        root = str(SCRIPTS.parent)
        path = os.pathsep.join(p for p in (str(SCRIPTS), root, os.environ.get("PYTHONPATH"))
                               if p)
        args = ["-m", "dynamo_zmq.worker", "--engine", "_bench_stuck_mocker:SwitchedStuckMocker",
                "--model-path", str(model), "--model-name", "tiny", "--namespace", ns,
                "--host", "127.0.0.1", "--discovery", discovery, "--speedup-ratio", "1",
                "--graceful-timeout", "1"]
        with Child(args, env={"PYTHONPATH": path}) as proc:
            proc.wait_ready(60)
            rt = runtime_for(discovery, proc.address)
            try:
                client = await rt.endpoint(f"{ns}.backend.generate").client()
                await client.wait_for_instances(timeout=30)
                return [await stuck_once(rt, client, proc, max_seconds) for _ in range(trials)]
            finally:
                await rt.close()


async def stuck_once(rt: DistributedRuntime, client: Client, proc: Child,
                     max_seconds: float) -> float:
    iid = proc.instance_id
    await until_routed(rt, client, iid, True, time.perf_counter(), max_seconds)
    streams = [await client.generate(STREAM) for _ in range(2)]
    for stream in streams:
        await stream.__anext__()
    readers = [asyncio.create_task(read_quietly(s)) for s in streams]
    try:
        await asyncio.sleep(0.2 + random.uniform(0, PING_INTERVAL))
        t0 = time.perf_counter()
        proc.signal(signal.SIGUSR1)  # the engine stops producing
        gone = await until_routed(rt, client, iid, False, t0, max_seconds)
        proc.signal(signal.SIGUSR1)  # and starts again: its canary answers, it comes back
        await until_routed(rt, client, iid, True, time.perf_counter(), max_seconds)
        return gone
    finally:
        for stream in streams:
            await stream.aclose()
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)


async def idle_cost(peers: int, servers: int, seconds: float, answer: float | None) -> float:
    """This process's CPU (% of one core) while ``peers`` idle connections are pinged."""
    ns = f"bench{uuid.uuid4().hex[:8]}"
    args = [BENCH_SERVER, "--namespace", ns, "--host", "127.0.0.1", "--discovery", "static"]
    children = [Child(args) for _ in range(servers)]
    res = Resources("idle-bench")
    conns: list[PeerConnection] = []
    try:
        for child in children:
            child.wait_ready()
        ticker = PingTicker(res, answer_timeout=answer)
        conns = [PeerConnection(res, children[i % servers].address, ticker=ticker)
                 for i in range(peers)]
        for conn in conns:
            conn.start()
        for conn in conns:
            await conn.wait_described(30)
        await asyncio.sleep(2)  # settled
        me = psutil.Process()
        cpu0, t0 = cpu_seconds(me), time.perf_counter()
        await asyncio.sleep(seconds)
        return 100 * (cpu_seconds(me) - cpu0) / (time.perf_counter() - t0)
    finally:
        for conn in conns:
            await conn.close()
        await res.close()
        for child in children:
            child.stop()


def ms(values: list[float]) -> str:
    v = [x * 1000 for x in values]
    return f"{percentile(v, 50):.0f} / {percentile(v, 99):.0f} / {max(v):.0f}"


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--discovery", choices=["mdns", "static"], default="mdns")
    parser.add_argument("--cases", default="kill,stop,stuck", help="of kill, stop, stuck")
    parser.add_argument("--max-seconds", type=float, default=30.0, help="bound on each trial")
    parser.add_argument("--idle-peers", default="", help="e.g. 256,512: measure idle cost only")
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--idle-runs", type=int, default=3)
    parser.add_argument("--servers", type=int, default=8, help="server processes (idle cost)")
    args = parser.parse_args()
    if args.idle_peers:
        print("| peers | answers judged (SILENT after) | CPU % of one core, each run |")
        print("|---|---|---|")
        for n in (int(x) for x in args.idle_peers.split(",")):
            cpu: dict[float | None, list[float]] = {None: [], ANSWER_TIMEOUT: []}
            for run in range(args.idle_runs):
                for answer in (None, ANSWER_TIMEOUT)[:: 1 if run % 2 == 0 else -1]:
                    cpu[answer].append(await idle_cost(n, args.servers, args.idle_seconds,
                                                       answer))
            for answer, runs in cpu.items():
                label = "no (pings only)" if answer is None else f"yes ({answer} s)"
                print(f"| {n} | {label} | {', '.join(f'{c:.2f}' for c in runs)} |", flush=True)
        return
    print("| case | discovery | trials | stream fails p50 / p99 / max (ms) "
          "| out of routing p50 / p99 / max (ms) |")
    print("|---|---|---|---|---|")
    cases = args.cases.split(",")
    for name, sig in (("kill", signal.SIGKILL), ("stop", signal.SIGSTOP)):
        if name not in cases:
            continue
        results = [await trial(sig, args.discovery, args.max_seconds)
                   for _ in range(args.trials)]
        print(f"| {'SIGKILL' if name == 'kill' else 'SIGSTOP'} | {args.discovery} "
              f"| {args.trials} | {ms([r[0] for r in results])} "
              f"| {ms([r[1] for r in results])} |", flush=True)
    if "stuck" in cases:
        gones = await stuck_trials(args.trials, args.discovery, args.max_seconds)
        print(f"| engine stops producing | {args.discovery} | {args.trials} "
              f"| (stall timeout) | {ms(gones)} |", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
