"""Request-plane throughput: items/s and requests/s between two real processes, and our request
plane side by side with a bare pyzmq loop doing the same streaming.

    python scripts/bench_request_plane.py [--items 200000] [--requests 5000]
        [--concurrency 1,16,64] [--rounds 1] [--bare-batches 1,16,256] [--max-seconds 60]
        [--server-uvloop] [--no-uvloop]

Two server processes on loopback: ``scripts/_bench_server.py`` (our runtime, static discovery)
and ``scripts/_bare_zmq_server.py`` (bare pyzmq); this process is the client of both (uvloop
unless ``--no-uvloop``; the servers run the stdlib loop unless ``--server-uvloop``).

Table 1 (ours only), per scenario: wall time, items/s (or requests/s), and CPU seconds used by
each side, read from /proc via psutil:
- stream items: ``--concurrency`` streams at once, ``--items`` items in all, from ``count``;
- 1-item requests: ``--requests`` requests of one item each, ``--concurrency`` at a time.

Table 2 (side by side, ``--rounds`` times, ours then bare at each concurrency): the same
``--items`` streamed by our ``Client`` (``generate(..., annotated=False)``, items decoded) and by
a bare ``zmq.asyncio`` DEALER client (``await recv_multipart()`` per message, msgspec decode,
count). Equal batching: our server coalesces what is ready per event-loop tick, at most 256
items per stream frame, and sends all streams to one client in one message per tick. The
script counts the ZMQ messages our client received during the run (``frames_received`` of its
connection; the few pongs included) and runs the bare server at that many items per message,
rounded (and at most the items per stream). ``ours / bare`` is the ratio of items/s; CPU
seconds are per side (server process, client process). Optional ``--bare-batches`` adds a
table of the bare loop at fixed items per message, for scale.

Every scenario is bounded by ``--max-seconds`` (it fails rather than hang); the servers are
always stopped (SIGTERM, then SIGKILL after 10 s).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import psutil
import zmq
import zmq.asyncio
from _bench_child import BARE_SERVER, BENCH_SERVER, Child, cpu_seconds, run

from dynamo_zmq.discovery import DiscoveryConfig
from dynamo_zmq.runtime import Client, DistributedRuntime, RuntimeConfig

HWM = 10_000


@dataclass
class Sample:
    wall: float
    server_cpu: float
    client_cpu: float


async def timed(
    work: Callable[[], Awaitable[None]], server: psutil.Process, max_seconds: float
) -> Sample:
    """Run ``work`` (bounded by ``max_seconds``) and measure wall and CPU seconds per side."""
    me = psutil.Process()
    s0, c0, t0 = cpu_seconds(server), cpu_seconds(me), time.perf_counter()
    await asyncio.wait_for(work(), max_seconds)
    wall = time.perf_counter() - t0
    return Sample(wall, cpu_seconds(server) - s0, cpu_seconds(me) - c0)


def messages_received(client: Client) -> int:
    return sum(conn.frames_received for conn in client.instances())


class BareClient:
    """The bare side's client: one ``zmq.asyncio`` DEALER; requests ``[id, n, batch, produce]``,
    answers ``[id, seq, items]`` ending with ``[id, seq, None]``.

    ``same_work=False``: the least work there is (the server builds each frame's items in one
    list comprehension; this side decodes each message and counts its items). ``True``: the
    work the runtime does, without it (the server takes the items one at a time from an async
    generator; each stream here hands its items one at a time to an ``async for`` consumer).
    """

    def __init__(self, address: str) -> None:
        self._zctx = zmq.asyncio.Context()
        self._sock = self._zctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, HWM)
        self._sock.setsockopt(zmq.RCVHWM, HWM)
        self._sock.connect(address)
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder().decode
        self._next_id = 1

    async def stream(self, concurrency: int, per: int, batch: int, same_work: bool = False) -> int:
        """Stream ``per`` items on each of ``concurrency`` requests at once; returns the items
        received (checks each stream's sequence numbers and item count)."""
        ids = []
        for _ in range(concurrency):
            request_id, self._next_id = self._next_id, self._next_id + 1
            ids.append(request_id)
            await self._sock.send(self._encode((request_id, per, batch, int(same_work))))
        if same_work:
            return await self._consume_each(ids, per)
        expected = dict.fromkeys(ids, 0)
        counts = dict.fromkeys(ids, 0)
        total = 0
        while expected:
            request_id, seq, items = self._decode(await self._sock.recv())
            if seq != expected[request_id]:
                raise RuntimeError(
                    f"bare stream {request_id}: frame {seq}, expected {expected[request_id]}"
                )
            if items is None:
                if counts[request_id] != per:
                    raise RuntimeError(f"bare stream {request_id}: {counts[request_id]} items")
                del expected[request_id]
                continue
            expected[request_id] = seq + 1
            counts[request_id] += len(items)
            total += len(items)
        return total

    async def _consume_each(self, ids: list[int], per: int) -> int:
        """One reader task demultiplexes messages into per-stream queues; each stream's consumer
        iterates its items with ``async for`` over a plain async generator."""
        queues: dict[int, asyncio.Queue[list[Any] | None]] = {i: asyncio.Queue() for i in ids}
        expected = dict.fromkeys(ids, 0)

        async def read() -> None:
            open_streams = len(ids)
            while open_streams:
                request_id, seq, items = self._decode(await self._sock.recv())
                if seq != expected[request_id]:
                    raise RuntimeError(f"bare stream {request_id}: frame {seq}")
                expected[request_id] = seq + 1
                queues[request_id].put_nowait(items)
                open_streams -= items is None

        async def items_of(request_id: int) -> AsyncIterator[Any]:
            queue = queues[request_id]
            while (items := await queue.get()) is not None:
                for item in items:
                    yield item

        async def consume(request_id: int) -> int:
            got = 0
            async for _ in items_of(request_id):
                got += 1
            if got != per:
                raise RuntimeError(f"bare stream {request_id}: {got} items")
            return got

        reader = asyncio.create_task(read())
        try:
            counts = await asyncio.gather(*(consume(i) for i in ids))
            await reader
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        return sum(counts)

    def close(self) -> None:
        self._sock.close(linger=0)
        self._zctx.term()


async def ours_table(client: Client, server: psutil.Process, args: argparse.Namespace) -> None:
    """Table 1, as this script always printed it."""
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    print("| scenario | volume | wall s | per second | server CPU s | client CPU s |")
    print("|---|---|---|---|---|---|")

    def row(label: str, count: int, unit: str, s: Sample) -> None:
        print(
            f"| {label} | {count:,} {unit} | {s.wall:.2f} | {count / s.wall:,.0f} | "
            f"{s.server_cpu:.2f} | {s.client_cpu:.2f} |",
            flush=True,
        )

    for conc in concurrencies:
        per = args.items // conc
        s = await timed(functools.partial(stream_ours, client, conc, per), server,
                        args.max_seconds)
        row(f"stream items, {conc} concurrent", per * conc, "items", s)

    for conc in concurrencies:
        total = args.requests

        async def small_requests(conc: int = conc, total: int = total) -> None:
            remaining = iter(range(total))

            async def worker() -> None:
                for _ in remaining:
                    async for _ in await client.generate({"n": 1}, annotated=False):
                        pass

            await asyncio.gather(*(worker() for _ in range(conc)))

        s = await timed(small_requests, server, args.max_seconds)
        row(f"1-item requests, {conc} concurrent", total, "requests", s)


async def stream_ours(client: Client, conc: int, per: int) -> None:
    async def one() -> None:
        got = 0
        async for _ in await client.generate({"n": per}, annotated=False):
            got += 1
        if got != per:
            raise RuntimeError(f"stream ended after {got} of {per} items")

    await asyncio.gather(*(one() for _ in range(conc)))


async def side_by_side(
    client: Client,
    bare: BareClient,
    ours_proc: psutil.Process,
    bare_proc: psutil.Process,
    args: argparse.Namespace,
) -> None:
    """Table 2: ours, then the bare loop doing the same work, then the bare loop doing the
    least work, at the same items per message, per concurrency and round."""
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    print()
    print(
        "| round | streams | items | ours items/s | bare, same work | ours / same work "
        "| bare, least work | ours / least work | items per message "
        "| CPU s server / client: ours, same work, least work |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rnd in range(1, args.rounds + 1):
        for conc in concurrencies:
            per = args.items // conc
            total = per * conc
            m0 = messages_received(client)
            ours = await timed(functools.partial(stream_ours, client, conc, per),
                               ours_proc, args.max_seconds)
            messages = max(1, messages_received(client) - m0)
            batch = max(1, min(per, round(total / messages)))
            bare_runs = []
            for same_work in (True, False):

                async def bare_run(
                    conc: int = conc, per: int = per, batch: int = batch, same: bool = same_work
                ) -> None:
                    got = await bare.stream(conc, per, batch, same_work=same)
                    if got != conc * per:
                        raise RuntimeError(f"bare loop delivered {got}, expected {conc * per}")

                bare_runs.append(await timed(bare_run, bare_proc, args.max_seconds))
            same, least = bare_runs
            rate = total / ours.wall
            same_rate, least_rate = total / same.wall, total / least.wall
            cpu = " / ".join(f"{x.server_cpu:.2f}+{x.client_cpu:.2f}" for x in (ours, same, least))
            print(
                f"| {rnd} | {conc} | {total:,} | {rate:,.0f} | {same_rate:,.0f} "
                f"| {rate / same_rate:.2f}x | {least_rate:,.0f} | {rate / least_rate:.2f}x "
                f"| {total / messages:.1f} / {batch} | {cpu} |",
                flush=True,
            )


async def bare_fixed(bare: BareClient, bare_proc: psutil.Process, args: argparse.Namespace) -> None:
    """Table 3 (optional): the bare loop at fixed items per message."""
    batches = [int(b) for b in args.bare_batches.split(",") if b.strip()]
    if not batches:
        return
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    print()
    print("| bare items per message | streams | items | items/s | server CPU s | client CPU s |")
    print("|---|---|---|---|---|---|")
    for batch in batches:
        for conc in concurrencies:
            per = args.items // conc

            async def bare_run(conc: int = conc, per: int = per, batch: int = batch) -> None:
                await bare.stream(conc, per, batch)

            s = await timed(bare_run, bare_proc, args.max_seconds)
            print(
                f"| {batch} | {conc} | {per * conc:,} | {per * conc / s.wall:,.0f} "
                f"| {s.server_cpu:.2f} | {s.client_cpu:.2f} |",
                flush=True,
            )


async def main(args: argparse.Namespace) -> None:
    ns = f"bench{uuid.uuid4().hex[:8]}"
    loop_flag = ["--uvloop"] if args.server_uvloop else []
    ours_args = [BENCH_SERVER, "--namespace", ns, "--host", "127.0.0.1", "--discovery", "static"]
    with Child([*ours_args, *loop_flag]) as ours_child, \
            Child([BARE_SERVER, "--host", "127.0.0.1", *loop_flag]) as bare_child:
        ours_child.wait_ready()
        bare_child.wait_ready()
        disc = DiscoveryConfig(backend="static", static_addresses=(ours_child.address,))
        rt = DistributedRuntime(config=RuntimeConfig(discovery=disc, host="127.0.0.1"))
        bare = BareClient(bare_child.address)
        try:
            client = await rt.endpoint(f"{ns}.backend.count").client()
            await client.wait_for_instances(timeout=15)
            await ours_table(client, ours_child.process, args)
            # Warm the bare connection up (the runtime's was, by table 1).
            await asyncio.wait_for(bare.stream(1, 1000, 64), args.max_seconds)
            await side_by_side(client, bare, ours_child.process, bare_child.process, args)
            await bare_fixed(bare, bare_child.process, args)
        finally:
            bare.close()
            await rt.close()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--items", type=int, default=200_000, help="items per stream scenario")
    parser.add_argument("--requests", type=int, default=5_000, help="1-item requests per level")
    parser.add_argument("--concurrency", default="1,16,64", help="comma-separated levels")
    parser.add_argument("--rounds", type=int, default=1, help="side-by-side rounds")
    parser.add_argument("--bare-batches", default="",
                        help="comma-separated fixed items per message for an extra bare table")
    parser.add_argument("--max-seconds", type=float, default=60.0,
                        help="bound on each scenario; it fails if it takes longer")
    parser.add_argument("--server-uvloop", action="store_true",
                        help="run both server processes on uvloop")
    parser.add_argument("--no-uvloop", action="store_true",
                        help="run this (client) process on the stdlib loop")
    args = parser.parse_args()
    if args.items < 1 or args.requests < 1 or args.rounds < 1 or args.max_seconds <= 0:
        parser.error("--items, --requests, --rounds and --max-seconds must be positive")
    return args


if __name__ == "__main__":
    cli = parse_args()
    run(main(cli), use_uvloop=not cli.no_uvloop and os.environ.get("DYN_UVLOOP", "1") == "1")
