"""``python -m dynamo_zmq.tools.uds_forward SOCKET PORT``: forward a Unix socket to a TCP port.

Run inside a network namespace (``ip netns exec NS python -m ...``), it lets a process outside
reach ``127.0.0.1:PORT`` of that namespace: Unix sockets live in the file system, not in a
network namespace. Each connection to ``SOCKET`` gets its own TCP connection; bytes are copied
both ways until either side closes. Prints ``READY unix:SOCKET`` once listening; SIGTERM stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from typing import Any

__all__ = ["forward"]


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def forward(path: str, port: int, host: str = "127.0.0.1") -> None:
    """Serve ``path`` until SIGTERM or SIGINT, forwarding each connection to ``host:port``."""
    tasks: set[asyncio.Task[Any]] = set()

    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()  # nothing listens there (yet): the caller sees a closed connection
            return
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            tasks.discard(task)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = await asyncio.start_unix_server(on_client, path)
    print(f"READY unix:{path}", flush=True)
    async with server:
        await stop.wait()
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


if __name__ == "__main__":
    asyncio.run(forward(sys.argv[1], int(sys.argv[2])))
