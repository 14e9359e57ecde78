"""How fast a dead or frozen instance stops being routed to, and its streams fail.

    python scripts/bench_liveness.py [--trials 5] [--discovery mdns|static]

For each trial: start a server process, stream from it, then SIGKILL (TCP reset) or SIGSTOP
(silent, like a hung host) it, and time (a) the open stream ending with Disconnected and (b) the
instance leaving the client's routing set. mDNS is pinned to loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DYN_MDNS_INTERFACES", "127.0.0.1")

from dynamo_zmq import errors  # noqa: E402
from dynamo_zmq.discovery import DiscoveryConfig  # noqa: E402
from dynamo_zmq.runtime import DistributedRuntime, RuntimeConfig  # noqa: E402
from tests.support.procs import Proc  # noqa: E402


async def trial(sig: int, discovery: str) -> tuple[float, float]:
    ns = f"bench{uuid.uuid4().hex[:8]}"
    args = ["-m", "tests.support.app", "--namespace", ns, "--host", "127.0.0.1", "--discovery", discovery]
    proc = Proc(args).wait_ready()
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
        stream_end = gone = None
        async def drain() -> float:
            try:
                async for _ in stream:
                    pass
            except errors.Disconnected:
                return time.perf_counter() - t0
            raise AssertionError("stream ended without Disconnected")
        task = asyncio.create_task(drain())
        while client.instance_ids():
            await client._pool.wait_changed(0.05)
        gone = time.perf_counter() - t0
        stream_end = await asyncio.wait_for(task, 30)
        return stream_end, gone
    finally:
        proc.signal(signal.SIGCONT)
        proc.stop()
        await rt.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--discovery", choices=["mdns", "static"], default="mdns")
    args = parser.parse_args()
    print("| signal | discovery | trials | stream fails p50 / max (ms) | out of routing p50 / max (ms) |")
    print("|---|---|---|---|---|")
    for name, sig in (("SIGKILL", signal.SIGKILL), ("SIGSTOP", signal.SIGSTOP)):
        results = [await trial(sig, args.discovery) for _ in range(args.trials)]
        ends = [r[0] * 1000 for r in results]
        gones = [r[1] * 1000 for r in results]
        print(
            f"| {name} | {args.discovery} | {args.trials} | {statistics.median(ends):.0f} / {max(ends):.0f}"
            f" | {statistics.median(gones):.0f} / {max(gones):.0f} |"
        )


if __name__ == "__main__":
    asyncio.run(main())
