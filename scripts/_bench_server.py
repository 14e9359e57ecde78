"""The benchmarks' serving process, written against the public runtime API only.

    python scripts/_bench_server.py --namespace NS [--component backend] [--role server|middle]
        [--target backend] [--uvloop] [--host 127.0.0.1] [--discovery static|mdns]
        [--static-workers tcp://host:port,...]

Started by the ``bench_*.py`` scripts as a child process (``_bench_child.Child``); prints
``READY <address> <instance id hex>`` on stdout once its endpoints are served, then serves until
SIGTERM or SIGINT.

Endpoints, all in component ``--component`` of ``--namespace``:

- role ``server``:
  - ``count``: yields ``{"i": i, "instance": id}`` ``n`` times, ``delay`` seconds apart; returns
    early once its context is stopped.
  - ``hold``: yields ``{"started": t}``, waits until its context is stopped or killed (at most
    ``hold_s`` seconds), then yields ``{"fired": t}`` and returns. Times are ``time.monotonic()``
    (CLOCK_MONOTONIC, the same clock in every process of the host).
- role ``middle``:
  - ``relay``: calls ``<namespace>.<target>.hold`` with the same request, passing its own
    context on (so a stop travels on to the server), forwards every item, then yields
    ``{"middle_fired": t}``: when its own context fired.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from dynamo_zmq.runtime import (
    Client,
    Context,
    DistributedRuntime,
    RuntimeConfig,
    add_runtime_args,
)

#: Longest a ``hold`` request waits for its context when the request does not say.
DEFAULT_HOLD_S = 30.0
#: Longest the process waits for its endpoints to be registered before giving up.
READY_TIMEOUT_S = 10.0

Handler = Callable[[dict[str, Any], Context], AsyncIterator[dict[str, Any]]]


def server_handlers(runtime: DistributedRuntime) -> dict[str, Handler]:
    async def count(request: dict[str, Any], context: Context) -> AsyncIterator[dict[str, Any]]:
        n = int(request.get("n", 10))
        delay = float(request.get("delay", 0.0))
        for i in range(n):
            if context.is_stopped():
                return
            yield {"i": i, "instance": runtime.instance_id}
            if delay:
                await asyncio.sleep(delay)

    async def hold(request: dict[str, Any], context: Context) -> AsyncIterator[dict[str, Any]]:
        yield {"started": time.monotonic()}
        bound = float(request.get("hold_s", DEFAULT_HOLD_S))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(context.async_killed_or_stopped(), bound)
        fired = time.monotonic()
        yield {"fired": fired if context.is_stopped() else None}

    return {"count": count, "hold": hold}


def middle_handlers(runtime: DistributedRuntime, namespace: str, target: str) -> dict[str, Handler]:
    clients: list[Client] = []

    async def relay(request: dict[str, Any], context: Context) -> AsyncIterator[dict[str, Any]]:
        if not clients:
            client = await runtime.namespace(namespace).component(target).endpoint("hold").client()
            await client.wait_for_instances(timeout=10)
            clients.append(client)
        fired: list[float] = []

        async def watch() -> None:
            await context.async_killed_or_stopped()
            fired.append(time.monotonic())

        watcher = asyncio.create_task(watch())
        try:
            stream = await clients[0].generate(request, annotated=False, context=context)
            async for item in stream:
                yield item
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(watcher), 1.0)
            yield {"middle_fired": fired[0] if fired else None}
        finally:
            watcher.cancel()

    return {"relay": relay}


async def serve(args: argparse.Namespace) -> None:
    runtime = DistributedRuntime(config=RuntimeConfig.from_args(args))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, runtime.shutdown)
    if args.role == "middle":
        handlers = middle_handlers(runtime, args.namespace, args.target)
    else:
        handlers = server_handlers(runtime)
    component = runtime.namespace(args.namespace).component(args.component)
    await component.create_service()
    # serve_endpoint serves until the runtime shuts down; no graceful drain: a benchmark's
    # server is stopped only once its caller is done with it.
    serving = [
        asyncio.create_task(
            component.endpoint(name).serve_endpoint(handler, graceful_shutdown=False)
        )
        for name, handler in handlers.items()
    ]
    try:
        wanted = {f"{args.namespace}.{args.component}.{name}" for name in handlers}
        deadline = loop.time() + READY_TIMEOUT_S
        while not wanted <= {e.path for e in runtime.describe().endpoints}:
            if loop.time() > deadline or any(t.done() for t in serving):
                raise RuntimeError(f"endpoints {sorted(wanted)} not served in time")
            await asyncio.sleep(0.005)
        print(f"READY {runtime.address} {runtime.instance_id:x}", flush=True)
        await asyncio.gather(*serving)
    finally:
        for task in serving:
            task.cancel()
        await runtime.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--component", default="backend")
    parser.add_argument("--role", choices=["server", "middle"], default="server")
    parser.add_argument("--target", default="backend", help="component the middle relays to")
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop (if installed)")
    add_runtime_args(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            uvloop.run(serve(args))
            return
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
