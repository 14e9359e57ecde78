"""A bare pyzmq streaming server: the baseline ``bench_request_plane.py`` compares against.

    python scripts/_bare_zmq_server.py [--host 127.0.0.1] [--uvloop]

Started by ``bench_request_plane.py`` as a child process; prints ``READY <address> <id hex>``
on stdout once bound, then serves until SIGTERM or SIGINT.

Written the way a competent engineer would write it with ``zmq.asyncio``: one ROUTER socket
(``ROUTER_MANDATORY``, so a full peer queue makes ``send`` wait instead of dropping; the same
10,000-message high-water marks as the runtime), one asyncio task per request, ``await
recv_multipart()`` per request and ``await send_multipart()`` per frame (no drain loop: at
hundreds of items per frame the per-``await`` cost does not matter). A request is the
MessagePack array ``[request_id, n, batch, produce]``; the answer is ``ceil(n / batch)`` frames
``[request_id, seq, items]`` with up to ``batch`` items ``{"i": i, "instance": id}`` each (the
items the runtime's ``count`` endpoint yields; ``id`` is a random 63-bit int, as there), then
``[request_id, seq, None]`` to end. Encoding is msgspec MessagePack, one ``encode`` per frame.
``produce`` 0 builds each frame's items with one list comprehension (the least work there is);
1 takes them one at a time from an async generator, as a handler of the runtime yields them (the
same work as the runtime's server does, without the runtime).
No flow control, cancellation, liveness or multiplexing of several streams into one message:
that is the point of a baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import signal
from collections.abc import AsyncIterator

import msgspec
import zmq
import zmq.asyncio

HWM = 10_000
#: Stands in for the runtime's instance id in every item (same size on the wire).
INSTANCE_ID = secrets.randbits(63) or 1


async def count(n: int) -> AsyncIterator[dict[str, int]]:
    """The items, one at a time (the runtime's ``count`` handler, without a context)."""
    for i in range(n):
        yield {"i": i, "instance": INSTANCE_ID}


async def stream(
    sock: zmq.asyncio.Socket, identity: bytes, request_id: int, n: int, batch: int, produce: int
) -> None:
    encode = msgspec.msgpack.Encoder().encode
    seq = 0
    if produce:
        items: list[dict[str, int]] = []
        async for item in count(n):
            items.append(item)
            if len(items) >= batch:
                await sock.send_multipart([identity, encode((request_id, seq, items))])
                seq += 1
                items = []
        if items:
            await sock.send_multipart([identity, encode((request_id, seq, items))])
            seq += 1
    else:
        for start in range(0, n, batch):
            items = [{"i": i, "instance": INSTANCE_ID} for i in range(start, min(n, start + batch))]
            await sock.send_multipart([identity, encode((request_id, seq, items))])
            seq += 1
    await sock.send_multipart([identity, encode((request_id, seq, None))])


async def serve(host: str) -> None:
    zctx = zmq.asyncio.Context()
    sock = zctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.bind(f"tcp://{host}:*")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    decode = msgspec.msgpack.Decoder(tuple[int, int, int, int]).decode
    tasks: set[asyncio.Task[None]] = set()
    print(f"READY {sock.getsockopt_string(zmq.LAST_ENDPOINT)} {INSTANCE_ID:x}", flush=True)

    async def receive() -> None:
        while True:
            identity, payload = await sock.recv_multipart()
            request_id, n, batch, produce = decode(payload)
            task = asyncio.create_task(
                stream(sock, identity, request_id, n, max(1, batch), produce)
            )
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    receiver = asyncio.create_task(receive())
    try:
        await stop.wait()
    finally:
        receiver.cancel()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(receiver, *tasks, return_exceptions=True)
        sock.close(linger=0)
        zctx.term()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop (if installed)")
    args = parser.parse_args()
    if args.uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            uvloop.run(serve(args.host))
            return
    asyncio.run(serve(args.host))


if __name__ == "__main__":
    main()
