"""Cancellation propagation latency: from ``ctx.stop_generating()`` on the caller to the moment
the handler's context fires, over one hop and over two.

    python scripts/bench_cancel.py [--requests 500] [--max-seconds 60] [--warmup 20]
        [--hops 1,2] [--plot FILE.png] [--no-uvloop] [--server-uvloop]

Real processes on loopback, static discovery: a server (``scripts/_bench_server.py``, endpoint
``hold``) and, for two hops, a middle process (endpoint ``relay``) that calls the server passing
its own context on (``await client.generate(request, context=context)``, as in Dynamo's
cancellation document). This process is the caller.

Per request: open a stream with a fresh ``Context``; wait for the first item (the handler is
then waiting in ``await context.async_killed_or_stopped()``); take ``t0 = time.monotonic()``
and call ``ctx.stop_generating()``; keep reading until the stream ends. After its context fires
the handler sends ``time.monotonic()`` back as a last item and returns (the middle adds when
its own context fired). CLOCK_MONOTONIC is one clock for every process of a Linux host, so
``fired - t0`` is the propagation latency, including the wake-up of the handler's task.

Requests run one at a time, ``--requests`` per hop count (after ``--warmup`` unmeasured ones),
or fewer if ``--max-seconds`` runs out first; each request is bounded too. Prints a markdown
table (hops, n, p50, p99, max in ms) and, for two hops, where the time goes per hop.
``--plot`` draws the latency distributions (needs matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

from _bench_child import BENCH_SERVER, Child, percentile, run

from dynamo_zmq.discovery import DiscoveryConfig
from dynamo_zmq.runtime import Client, Context, DistributedRuntime, RuntimeConfig

#: Longest one request may take end to end before the benchmark gives up on it.
REQUEST_TIMEOUT_S = 10.0
#: Longest a handler waits for its context (so no server task can outlive the benchmark).
HOLD_S = 8.0
#: Failed or timed-out requests tolerated before the benchmark aborts.
MAX_FAILURES = 10


class Sample:
    __slots__ = ("middle", "total")

    def __init__(self, total: float, middle: float | None) -> None:
        self.total = total  # ms from stop_generating() to the server's context firing
        self.middle = middle  # ms from stop_generating() to the middle's context firing


async def one(client: Client) -> Sample:
    """One request: open, wait for the first item, stop, read to the end."""
    ctx = Context()
    stream = await client.generate({"hold_s": HOLD_S}, annotated=False, context=ctx)
    first = await stream.__anext__()
    if "started" not in first:
        raise RuntimeError(f"unexpected first item {first!r}")
    t0 = time.monotonic()
    ctx.stop_generating()
    fired: float | None = None
    middle: float | None = None
    items = 0
    async for item in stream:  # bounded: the handler sends at most two more items
        items += 1
        if items > 4:
            raise RuntimeError("stream kept going after the stop")
        fired = item.get("fired", fired)
        middle = item.get("middle_fired", middle)
    if fired is None:
        raise RuntimeError("the handler's context never fired")
    return Sample((fired - t0) * 1e3, None if middle is None else (middle - t0) * 1e3)


async def measure(client: Client, args: argparse.Namespace) -> list[Sample]:
    samples: list[Sample] = []
    failures = 0
    for _ in range(args.warmup):
        await asyncio.wait_for(one(client), REQUEST_TIMEOUT_S)
    deadline = time.monotonic() + args.max_seconds
    for _ in range(args.requests):
        if time.monotonic() > deadline:
            break
        try:
            samples.append(await asyncio.wait_for(one(client), REQUEST_TIMEOUT_S))
        except (asyncio.TimeoutError, RuntimeError) as exc:
            failures += 1
            print(f"request failed: {exc!r}", flush=True)
            if failures >= MAX_FAILURES:
                raise RuntimeError(f"{failures} requests failed; giving up") from exc
    return samples


def stats(values: list[float]) -> str:
    return (
        f"{percentile(values, 50):.2f} | {percentile(values, 99):.2f} | {max(values):.2f}"
    )


def plot(results: dict[int, list[Sample]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, ax = plt.subplots(figsize=(7, 4))
    for hops, samples in results.items():
        values = sorted(s.total for s in samples)
        if not values:
            continue
        fractions = [(i + 1) / len(values) for i in range(len(values))]
        ax.step(values, fractions, where="post", label=f"{hops} hop{'s' if hops > 1 else ''}")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("stop_generating() -> handler's context fired (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Cancellation propagation latency (loopback)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


async def main(args: argparse.Namespace) -> None:
    hops_wanted = sorted({int(h) for h in args.hops.split(",")})
    if not set(hops_wanted) <= {1, 2}:
        raise SystemExit("--hops takes 1 and/or 2")
    ns = f"bench{uuid.uuid4().hex[:8]}"
    loop_flag = ["--uvloop"] if args.server_uvloop else []
    common = ["--namespace", ns, "--host", "127.0.0.1", "--discovery", "static", *loop_flag]
    children: list[Child] = []
    rt: DistributedRuntime | None = None
    results: dict[int, list[Sample]] = {}
    try:
        server = Child([BENCH_SERVER, *common])
        children.append(server)
        server.wait_ready()
        addresses = [server.address]
        if 2 in hops_wanted:
            middle = Child([BENCH_SERVER, *common, "--role", "middle", "--component", "middle",
                            "--target", "backend", "--static-workers", server.address])
            children.append(middle)
            middle.wait_ready()
            addresses.append(middle.address)
        disc = DiscoveryConfig(backend="static", static_addresses=tuple(addresses))
        rt = DistributedRuntime(config=RuntimeConfig(discovery=disc, host="127.0.0.1"))
        paths = {1: f"{ns}.backend.hold", 2: f"{ns}.middle.relay"}
        for hops in hops_wanted:
            client = await rt.endpoint(paths[hops]).client()
            await client.wait_for_instances(timeout=15)
            results[hops] = await measure(client, args)
    finally:
        if rt is not None:
            await rt.close()
        for child in reversed(children):
            child.stop()

    print("| hops | n | p50 ms | p99 ms | max ms |")
    print("|---|---|---|---|---|")
    for hops, samples in results.items():
        if samples:
            print(f"| {hops} | {len(samples)} | {stats([s.total for s in samples])} |")
        else:
            print(f"| {hops} | 0 | - | - | - |")
    first_hop = [s.middle for s in results.get(2, []) if s.middle is not None]
    second_hop = [s.total - s.middle for s in results.get(2, []) if s.middle is not None]
    if first_hop:
        print()
        print("| two hops, per hop | n | p50 ms | p99 ms | max ms |")
        print("|---|---|---|---|---|")
        print(f"| caller -> middle | {len(first_hop)} | {stats(first_hop)} |")
        print(f"| middle -> server | {len(second_hop)} | {stats(second_hop)} |")
    if args.plot:
        plot(results, args.plot)
        print(f"\nplot written to {args.plot}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=500, help="measured requests per hop count")
    parser.add_argument("--warmup", type=int, default=20, help="unmeasured requests first")
    parser.add_argument("--max-seconds", type=float, default=60.0,
                        help="time bound per hop count (fewer requests if it runs out)")
    parser.add_argument("--hops", default="1,2", help="1, 2 or 1,2")
    parser.add_argument("--plot", metavar="FILE", help="write a CDF plot (needs matplotlib)")
    parser.add_argument("--server-uvloop", action="store_true",
                        help="run the server processes on uvloop")
    parser.add_argument("--no-uvloop", action="store_true",
                        help="run this (caller) process on the stdlib loop")
    args = parser.parse_args()
    if args.requests < 1 or args.warmup < 0 or args.max_seconds <= 0:
        parser.error("--requests and --max-seconds must be positive, --warmup not negative")
    return args


if __name__ == "__main__":
    cli = parse_args()
    run(main(cli), use_uvloop=not cli.no_uvloop)
