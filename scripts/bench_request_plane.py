"""Request-plane throughput: items/s and requests/s between two real processes.

    python scripts/bench_request_plane.py [--items 200000] [--requests 5000] [--concurrency 1,16,64]

A server process (tests/support/app.py) streams ``count`` items; this process is the client.
Reported per scenario: wall time, items/s (or requests/s), and CPU seconds used by each side,
read from /proc via psutil.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dynamo_zmq.discovery import DiscoveryConfig  # noqa: E402
from dynamo_zmq.runtime import DistributedRuntime, RuntimeConfig  # noqa: E402
from tests.support.procs import Proc  # noqa: E402


def cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


async def measure(label, work, server: psutil.Process, count: int, unit: str) -> None:
    me = psutil.Process()
    s0, c0, t0 = cpu(server), cpu(me), time.perf_counter()
    await work()
    wall = time.perf_counter() - t0
    print(
        f"| {label} | {count:,} {unit} | {wall:.2f} | {count / wall:,.0f} | "
        f"{cpu(server) - s0:.2f} | {cpu(me) - c0:.2f} |"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=200_000)
    parser.add_argument("--requests", type=int, default=5_000)
    parser.add_argument("--concurrency", default="1,16,64")
    args = parser.parse_args()
    ns = f"bench{uuid.uuid4().hex[:8]}"
    proc = Proc(["-m", "tests.support.app", "--namespace", ns, "--host", "127.0.0.1", "--discovery", "static"])
    proc.wait_ready()
    server = psutil.Process(proc.pid)
    disc = DiscoveryConfig(backend="static", static_addresses=(proc.address,))
    rt = DistributedRuntime(config=RuntimeConfig(discovery=disc, host="127.0.0.1"))
    try:
        client = await rt.endpoint(f"{ns}.backend.count").client()
        await client.wait_for_instances(timeout=15)
        print("| scenario | volume | wall s | per second | server CPU s | client CPU s |")
        print("|---|---|---|---|---|---|")
        for conc in [int(c) for c in args.concurrency.split(",")]:
            per = args.items // conc

            async def stream_items(per=per, conc=conc) -> None:
                async def one() -> None:
                    async for _ in await client.generate({"n": per}, annotated=False):
                        pass

                await asyncio.gather(*(one() for _ in range(conc)))

            await measure(f"stream items, {conc} concurrent", stream_items, server, per * conc, "items")

        for conc in [int(c) for c in args.concurrency.split(",")]:
            total = args.requests

            async def small_requests(conc=conc, total=total) -> None:
                remaining = iter(range(total))

                async def worker() -> None:
                    for _ in remaining:
                        async for _ in await client.generate({"n": 1}, annotated=False):
                            pass

                await asyncio.gather(*(worker() for _ in range(conc)))

            await measure(f"1-item requests, {conc} concurrent", small_requests, server, total, "requests")
    finally:
        await rt.close()
        proc.stop()


if __name__ == "__main__":
    if os.environ.get("DYN_UVLOOP", "1") == "1":
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
    asyncio.run(main())
