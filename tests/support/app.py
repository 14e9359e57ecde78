"""A small serving process for tests: ``python -m tests.support.app --role server|middle ...``.

Endpoints (all in ``--namespace``, component ``--component``):
- ``count``: yields ``{"i", "instance"}`` ``n`` times, ``delay`` seconds apart (the first
  after ``wait`` seconds); notes in its journal whether its context was stopped or killed.
- ``journal``: yields the journal entries for ``context_id`` (what ``count`` observed).
- ``relay`` (role middle): calls ``<namespace>.<target>.count`` passing its own context on.
- ``lease`` (with ``--lease-endpoint``): yields ``{"lease_id", "valid"}`` of the runtime's
  primary lease, then revokes it if the request says ``{"revoke": true}``.

With ``--canary-file PATH`` (TEST ONLY), ``count`` is served with a ``health_check_payload`` and
fails while PATH exists: a test breaks and repairs its health from outside.

Prints ``READY <address> <instance_id hex>`` on stdout once serving, then serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from dynamo_zmq.runtime import Context, DistributedRuntime, RuntimeConfig, add_runtime_args

JOURNAL: dict[str, list[str]] = {}


def _exists(path: str) -> bool:
    return Path(path).exists()


def make_handlers(runtime: DistributedRuntime, args: argparse.Namespace):
    async def count(request: dict, context: Context):
        if args.canary_file and _exists(args.canary_file):
            raise RuntimeError("broken by the test switch")
        n = int(request.get("n", 10))
        delay = float(request.get("delay", 0.0))
        first_wait = float(request.get("wait", 0.0))  # before the first item: a "prefill"
        payload = "x" * int(request.get("pad", 0))
        note = JOURNAL.setdefault(context.id(), [])
        note.append("started")
        try:
            if first_wait:
                await asyncio.sleep(first_wait)
            for i in range(n):
                if context.is_stopped():  # a kill lets the handler look before cancelling it
                    note.append("killed" if context.is_killed() else "stopped")
                    return
                item = {"i": i, "instance": runtime.instance_id}
                if payload:
                    item["pad"] = payload
                yield item
                if delay:
                    await asyncio.sleep(delay)
            note.append("completed")
        except asyncio.CancelledError:
            note.append("killed" if context.is_killed() else "cancelled")
            raise

    async def journal(request: dict):
        for entry in JOURNAL.get(request["context_id"], []):
            yield entry

    async def relay(request: dict, context: Context):
        client = await runtime.endpoint(f"{args.namespace}.{args.target}.count").client()
        await client.wait_for_instances(timeout=10)
        stream = await client.generate(request, context=context)
        async for item in stream:
            yield item.data()

    async def lease(request: dict):
        primary = runtime.primary_lease()
        yield {"lease_id": runtime.lease_id(), "valid": primary.is_valid()}
        if request.get("revoke"):
            primary.revoke("revoked by a caller")

    return {"count": count, "journal": journal, "relay": relay, "lease": lease}


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--component", default="backend")
    parser.add_argument("--role", choices=["server", "middle"], default="server")
    parser.add_argument("--target", default="backend", help="component the middle relays to")
    parser.add_argument("--lease-endpoint", action="store_true", help="also serve `lease`")
    parser.add_argument("--canary-file", help="TEST ONLY: count fails while this file exists")
    add_runtime_args(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)

    runtime = DistributedRuntime(config=RuntimeConfig.from_args(args))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, runtime.shutdown)
    handlers = make_handlers(runtime, args)
    component = runtime.namespace(args.namespace).component(args.component)
    names = ["relay"] if args.role == "middle" else ["count", "journal"]
    if args.lease_endpoint:
        names.append("lease")
    for name in names:
        payload = {"n": 1} if name == "count" and args.canary_file else None
        await component.endpoint(name).start_serving(handlers[name], health_check_payload=payload)
    print(f"READY {runtime.address} {runtime.instance_id:x}", flush=True)
    await runtime.wait_shutdown()
    await runtime.drain(timeout=10)
    await runtime.close()


if __name__ == "__main__":
    asyncio.run(main())
