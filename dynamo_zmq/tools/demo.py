"""``python -m dynamo_zmq demo``: a worker and a client in two processes, end to end.

The parent starts a worker child that serves ``demo.backend.generate`` (an async generator that
streams a canned text back one word per item), finds it through discovery, streams one request,
prints the words as they arrive and a summary, then stops the child (SIGTERM, SIGKILL fallback).

    python -m dynamo_zmq demo                        # mDNS on 127.0.0.1
    python -m dynamo_zmq demo --discovery static     # no mDNS at all
    python -m dynamo_zmq demo --worker-only          # just the worker; then, in another shell:
    python -m dynamo_zmq status --namespace demo
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
from asyncio.subprocess import Process
from collections.abc import AsyncIterator
from typing import Any

from ..discovery import DiscoveryConfig
from ..errors import DynamoError
from ..runtime import Context, DistributedRuntime, RuntimeConfig, add_runtime_args, check_number
from .keys import load_keypair

ENDPOINT = "demo.backend.generate"
TEXT = (
    "ZeroMQ carries each request from the client straight to the worker, MessagePack keeps the "
    "frames small, and mDNS lets the two find each other without etcd, NATS or Kubernetes."
)


# -- the worker -----------------------------------------------------------------------------


async def generate(request: dict[str, Any], context: Context) -> AsyncIterator[dict[str, Any]]:
    """Echo the prompt, then stream ``TEXT`` one word per item; stop early when asked to."""
    delay = float(request.get("delay", 0.02))
    words = ["You", "said:", *str(request.get("prompt", "")).split(), "--", *TEXT.split()]
    for index, word in enumerate(words):
        if context.is_stopped():
            return
        yield {"index": index, "text": word}
        await asyncio.sleep(delay)


async def run_worker(config: RuntimeConfig) -> None:
    """Serve ``demo.backend.generate`` until SIGTERM/SIGINT, then drain and close."""
    runtime = DistributedRuntime(config=config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, runtime.shutdown)
    try:
        endpoint = runtime.namespace("demo").component("backend").endpoint("generate")
        await endpoint.component().create_service()  # binds the ROUTER socket
        print(f"READY {runtime.address} {runtime.instance_id:x}", flush=True)
        print(
            f"demo worker {runtime.instance_id:x} (pid {os.getpid()}) serving {ENDPOINT} on "
            f"{runtime.address}; try: python -m dynamo_zmq status --namespace demo",
            file=sys.stderr,
            flush=True,
        )
        await endpoint.serve_endpoint(generate)  # returns after SIGTERM, once drained
    finally:
        await runtime.close()


# -- the parent: start the worker, call it, stop it -----------------------------------------


async def start_worker(args: argparse.Namespace, config: RuntimeConfig) -> tuple[Process, str, int]:
    """Start ``--worker-only`` as a child; returns (process, address, instance id)."""
    flags = ["--discovery", config.discovery.backend, "--port", str(config.port)]
    if config.discovery.mdns_interfaces:
        flags += ["--mdns-interfaces", ",".join(config.discovery.mdns_interfaces)]
    if config.discovery.discovery_dir:
        flags += ["--discovery-dir", config.discovery.discovery_dir]
    if config.host:
        flags += ["--host", config.host]
    if config.auth_keys:
        flags += ["--auth-keys", config.auth_keys, "--auth-key-name", config.auth_key_name]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dynamo_zmq", "demo", "--worker-only", *flags,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    print(f"started demo worker pid {proc.pid}", flush=True)
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(args.timeout):
            while line := await proc.stdout.readline():
                if line.startswith(b"READY "):
                    _, address, iid = line.decode().split()
                    return proc, address, int(iid, 16)
    except BaseException:
        await stop_worker(proc)
        raise
    await stop_worker(proc)
    raise RuntimeError(f"demo worker exited with {proc.returncode} before it was ready")


async def stop_worker(proc: Process, grace: float = 10.0) -> None:
    """SIGTERM the child by pid, wait up to ``grace`` seconds, then SIGKILL."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            async with asyncio.timeout(grace):
                await proc.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            await proc.wait()
    print(f"stopped demo worker pid {proc.pid} (exit code {proc.returncode})", flush=True)


async def call_worker(
    config: RuntimeConfig,
    worker: Process,
    instance_id: int,
    request: dict[str, Any],
    timeout: float,
) -> None:
    """Discover the worker, stream one request from it, print items and a summary."""
    async with DistributedRuntime(config=config) as runtime:
        client = await runtime.endpoint(ENDPOINT).client()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        # Other demo workers may be running: wait for ours and call it directly.
        while instance_id not in client.instance_ids():
            remaining = deadline - loop.time()
            if worker.returncode is not None:
                raise RuntimeError(f"demo worker exited with {worker.returncode}")
            if remaining <= 0:
                raise TimeoutError(f"demo worker {instance_id:x} not discovered in {timeout:g}s")
            await runtime.wait_peers_changed(min(remaining, 0.2))
        print(f"found {ENDPOINT} on instance {instance_id:x}; streaming:", flush=True)
        start = time.perf_counter()
        first: float | None = None
        count = 0
        stream = await client.direct(request, instance_id)
        try:
            async for response in stream:
                first = first if first is not None else time.perf_counter() - start
                count += 1
                print(response.data()["text"], end=" ", flush=True)
        finally:
            print(flush=True)
        elapsed = time.perf_counter() - start
        ttft = f"{first * 1000:.1f} ms" if first is not None else "-"
        print(f"{count} items, first item after {ttft}, {count / elapsed:.1f} items/s", flush=True)


async def run_demo(args: argparse.Namespace, config: RuntimeConfig) -> None:
    """Start the worker, call it once, stop it (also when interrupted by SIGTERM or Ctrl-C)."""
    main_task = asyncio.current_task()
    assert main_task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    proc, address, instance_id = await start_worker(args, config)
    try:
        if config.discovery.backends == ("static",) and not config.discovery.static_addresses:
            # The client's static list is the worker just started.
            # With auth on the worker's key is this process's own (same key files).
            entry = address
            if config.auth_keys:
                key = load_keypair(config.auth_keys, config.auth_key_name)[0]
                entry = f"{address} key={key.decode()}"
            config = RuntimeConfig(
                discovery=_with_static(config.discovery, entry), auth_keys=config.auth_keys,
                auth_key_name=config.auth_key_name,
            )
        request = {"prompt": args.prompt, "delay": args.delay}
        await call_worker(config, proc, instance_id, request, args.timeout)
    finally:
        await stop_worker(proc)


def _with_static(discovery: DiscoveryConfig, address: str) -> DiscoveryConfig:
    return DiscoveryConfig(
        backend="static",
        static_addresses=(address,),
        static_file=discovery.static_file,
        mdns_interfaces=discovery.mdns_interfaces,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dynamo_zmq demo",
        description="Start a demo worker, stream one request from it, stop it.",
    )
    parser.add_argument(
        "--worker-only", action="store_true", help="run only the worker, until Ctrl-C"
    )
    parser.add_argument("--prompt", default="Hello, dynamo-zmq!", help="what the worker echoes")
    parser.add_argument(
        "--delay", type=float, default=0.02, help="seconds the worker waits between words"
    )
    parser.add_argument(
        "--timeout", type=float, default=30.0, help="seconds to wait for the worker"
    )
    add_runtime_args(parser)
    args = parser.parse_args(argv)
    try:
        check_number("--delay", args.delay)
        check_number("--timeout", args.timeout, positive=True)
    except DynamoError as exc:
        parser.error(exc.message)
    # Stay on this machine unless told otherwise (flag, or DYN_MDNS_INTERFACES).
    args.mdns_interfaces = args.mdns_interfaces or "127.0.0.1"
    config = RuntimeConfig.from_args(args)
    if args.worker_only:
        asyncio.run(run_worker(config))
        return 0
    try:
        asyncio.run(run_demo(args, config))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted", file=sys.stderr)
        return 130
    except (TimeoutError, RuntimeError, DynamoError) as exc:
        print(f"error: {exc or type(exc).__name__}", file=sys.stderr)
        return 1
    return 0

