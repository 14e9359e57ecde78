"""Handlers that record what cancellation they observed, for tests/test_cancellation.py.

    python -m tests.support.cancel_app --namespace NS --role server|middle [--kill-grace S] ...

Every handler notes in a journal, under its request's context id, what it saw; ``journal``
yields those notes (``{"context_id": id}``), so a test can ask each process what its handler
observed. Notes: ``started``; ``saw stop`` / ``saw stop+kill`` (the handler's own check of
``context.is_stopped()`` / ``is_killed()`` after an await); ``cancelled at an await`` (its task
was cancelled before it could look); ``completed``.

Role ``server`` (component ``backend``):
- ``work``: yields ``{"i": i}`` ``n`` times, ``delay`` seconds of "work" after each, checking the
  context after every await; ``raise``: on a stop, raise ``asyncio.CancelledError`` (the
  cancellation document's pattern) instead of returning; ``silent``: yield nothing before the
  first check.
- ``stubborn``: yields one item, then awaits an hour, never looking at its context.
- ``threaded``: yields ``{"started": True}``, then a worker thread (an engine's) calls
  ``context.<how>()`` while the handler awaits ``context.async_killed_or_stopped()``; notes
  ``woke`` and what the thread saw, and yields the same as its last item.
Role ``middle`` (component ``middle``):
- ``relay``: calls ``<namespace>.backend.work`` passing its own context on (the document's
  pattern), forwards its items with ``delay`` seconds of its own work after each, checking its
  context after every await; ``raise`` as for ``work``.

Prints ``READY <address> <instance id hex>`` once serving, then serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys
import threading
from typing import Any

from dynamo_zmq import errors
from dynamo_zmq.runtime import Context, DistributedRuntime, RuntimeConfig, add_runtime_args

JOURNAL: dict[str, list[Any]] = {}


def seen(context: Context) -> str:
    """What a handler's own check found: its context stopped, and maybe killed too."""
    return "saw stop+kill" if context.is_killed() else "saw stop"


def make_handlers(runtime: DistributedRuntime, args: argparse.Namespace) -> dict[str, Any]:
    async def work(request: dict[str, Any], context: Context):
        note = JOURNAL.setdefault(context.id(), [])
        note.append("started")
        delay = float(request.get("delay", 0.01))
        ended_on_stop = False
        try:
            for i in range(int(request.get("n", 1000))):
                if not request.get("silent"):
                    yield {"i": i}
                await asyncio.sleep(delay)  # the "work" between two checks
                if context.is_stopped():
                    note.append(seen(context))
                    ended_on_stop = True
                    break
            else:
                note.append("completed")
        except asyncio.CancelledError:
            note.append("cancelled at an await")
            raise
        if ended_on_stop and request.get("raise"):
            raise asyncio.CancelledError  # the cancellation document's handler pattern

    async def stubborn(request: dict[str, Any], context: Context):
        note = JOURNAL.setdefault(context.id(), [])
        yield {"i": 0}
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            note.append("cancelled at an await")
            raise

    async def threaded(request: dict[str, Any], context: Context):
        note = JOURNAL.setdefault(context.id(), [])
        yield {"started": True}
        waiter = asyncio.ensure_future(context.async_killed_or_stopped())
        await asyncio.sleep(0)  # the waiter is waiting before the thread acts
        report: dict[str, Any] = {}

        def engine_thread() -> None:
            try:
                getattr(context, request["how"])()
            except Exception as exc:  # e.g. a non-thread-safe call into the event loop
                report["thread_error"] = repr(exc)
            report["flags_in_thread"] = [context.is_stopped(), context.is_killed()]

        thread = threading.Thread(target=engine_thread, name="engine")
        thread.start()
        try:
            await asyncio.wait_for(waiter, 10)
            report["woke"] = True
        except asyncio.TimeoutError:
            report["woke"] = False
        await asyncio.to_thread(thread.join)
        note.append(report)
        yield report

    async def relay(request: dict[str, Any], context: Context):
        note = JOURNAL.setdefault(context.id(), [])
        delay = float(request.get("middle_delay", 0.01))
        client = await runtime.endpoint(f"{args.namespace}.backend.work").client()
        await client.wait_for_instances(timeout=10)
        ended_on_stop = False
        try:
            stream = await client.generate(request, context=context)
            async for item in stream:
                yield item.data()
                await asyncio.sleep(delay)  # the middle's own work between two checks
                if context.is_stopped():
                    note.append(seen(context))
                    ended_on_stop = True
                    break
            else:
                note.append("completed" if not context.is_stopped() else seen(context))
                ended_on_stop = context.is_stopped()
        except errors.Cancelled:  # killed with its caller: its own call ended at once
            note.append(seen(context))
            return
        except asyncio.CancelledError:
            note.append("cancelled at an await")
            raise
        if ended_on_stop and request.get("raise"):
            raise asyncio.CancelledError

    async def journal(request: dict[str, Any]):
        for entry in JOURNAL.get(request["context_id"], []):
            yield entry

    if args.role == "middle":
        return {"relay": relay, "journal": journal}
    return {"work": work, "stubborn": stubborn, "threaded": threaded, "journal": journal}


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--role", choices=["server", "middle"], default="server")
    parser.add_argument("--kill-grace", type=float, default=None)
    add_runtime_args(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)

    config = RuntimeConfig.from_args(args)
    if args.kill_grace is not None:
        config = dataclasses.replace(config, kill_grace=args.kill_grace)
    runtime = DistributedRuntime(config=config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, runtime.shutdown)
    component = runtime.namespace(args.namespace).component(
        "middle" if args.role == "middle" else "backend"
    )
    for name, handler in make_handlers(runtime, args).items():
        await component.endpoint(name).start_serving(handler)
    print(f"READY {runtime.address} {runtime.instance_id:x}", flush=True)
    await runtime.wait_shutdown()
    await runtime.drain(timeout=10)
    await runtime.close()


if __name__ == "__main__":
    asyncio.run(main())
