"""How fast a dead or frozen instance stops being routed to, and its streams fail.

    python scripts/bench_liveness.py [--trials 5] [--discovery mdns|static] [--max-seconds 30]

For each trial: start a server process (``scripts/_bench_server.py``), stream from it, then
SIGKILL (TCP reset) or SIGSTOP (silent, like a hung host) it, and time (a) the open stream
ending with Disconnected and (b) the instance leaving the client's routing set. mDNS is pinned
to loopback. Each trial is bounded by ``--max-seconds``; the server is always stopped (SIGCONT,
SIGTERM, then SIGKILL after 10 s).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import time
import uuid
from collections.abc import AsyncIterator

from _bench_child import BENCH_SERVER, Child

from dynamo_zmq import errors
from dynamo_zmq.discovery import DiscoveryConfig
from dynamo_zmq.runtime import DistributedRuntime, RuntimeConfig

os.environ.setdefault("DYN_MDNS_INTERFACES", "127.0.0.1")


async def trial(sig: int, discovery: str, max_seconds: float) -> tuple[float, float]:
    """One server, one stream, one signal; returns (stream fails, out of routing) in seconds."""
    ns = f"bench{uuid.uuid4().hex[:8]}"
    args = [BENCH_SERVER, "--namespace", ns, "--host", "127.0.0.1", "--discovery", discovery]
    with Child(args) as proc:
        proc.wait_ready()
        if discovery == "static":
            disc = DiscoveryConfig(backend="static", static_addresses=(proc.address,))
        else:
            disc = DiscoveryConfig(backend="mdns", mdns_interfaces=("127.0.0.1",))
        rt = DistributedRuntime(config=RuntimeConfig(discovery=disc, host="127.0.0.1"))
        try:
            client = await rt.endpoint(f"{ns}.backend.count").client()
            await client.wait_for_instances(timeout=15)
            stream = await client.generate({"n": 10_000_000, "delay": 0.002})
            await stream.__anext__()
            t0 = time.perf_counter()
            proc.signal(sig)
            task = asyncio.create_task(drain(stream, t0))
            try:
                while client.instance_ids():
                    if time.perf_counter() - t0 > max_seconds:
                        raise TimeoutError(f"instance still routed after {max_seconds}s")
                    await rt.wait_peers_changed(0.05)
                gone = time.perf_counter() - t0
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


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--discovery", choices=["mdns", "static"], default="mdns")
    parser.add_argument("--max-seconds", type=float, default=30.0, help="bound on each trial")
    args = parser.parse_args()
    print(
        "| signal | discovery | trials | stream fails p50 / max (ms) "
        "| out of routing p50 / max (ms) |"
    )
    print("|---|---|---|---|---|")
    for name, sig in (("SIGKILL", signal.SIGKILL), ("SIGSTOP", signal.SIGSTOP)):
        results = [await trial(sig, args.discovery, args.max_seconds) for _ in range(args.trials)]
        ends = [r[0] * 1000 for r in results]
        gones = [r[1] * 1000 for r in results]
        print(
            f"| {name} | {args.discovery} | {args.trials} "
            f"| {statistics.median(ends):.0f} / {max(ends):.0f}"
            f" | {statistics.median(gones):.0f} / {max(gones):.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    asyncio.run(main())
