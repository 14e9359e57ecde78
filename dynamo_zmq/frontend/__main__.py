"""``python -m dynamo_zmq.frontend``: the OpenAI-compatible HTTP entry point.

    python -m dynamo_zmq.frontend [--http-host 127.0.0.1] [--http-port 8000]
        [--router-mode round-robin|random|kv] [--namespace dynamo]
        [--kv-overlap-score-weight 1.0] [--router-temperature 0.0] [--no-kv-events]
        [--discovery mdns|static] [--static-workers tcp://h:p,...] [--request-timeout S]

Every flag has a ``DYN_*`` variable (``--http-port`` -> ``DYN_HTTP_PORT``). Prints
``READY http://HOST:PORT`` once it accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

import uvicorn

from .. import errors
from ..discovery import DiscoveryConfig, add_discovery_args, read_static_file
from ..runtime import DistributedRuntime, RuntimeConfig, check_name, check_number, setup_logging
from .app import FrontendApp
from .models import ModelManager

# The KV router's flags; loaded by name like the router itself (it depends on this package).
_kv_options = importlib.import_module("router.options")

log = logging.getLogger("dynamo_zmq.frontend")

ROUTER_MODES = {"round-robin": "round_robin", "random": "random", "kv": "kv"}
#: The KV router lives in the ``router`` package, which depends on this one: it is loaded by name
#: when ``--router-mode kv`` asks for it, never imported statically.
KV_ROUTER_MODULE = "router.kv_router"


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="python -m dynamo_zmq.frontend", description=__doc__.split("\n\n")[0])
    parser.add_argument("--http-host", default=env("DYN_HTTP_HOST", "127.0.0.1"), help="[DYN_HTTP_HOST]")
    parser.add_argument("--http-port", type=int, default=env("DYN_HTTP_PORT", "8000"), help="0 = any [DYN_HTTP_PORT]")
    parser.add_argument(
        "--router-mode", choices=sorted(ROUTER_MODES), default=env("DYN_ROUTER_MODE", "round-robin"),
        help="[DYN_ROUTER_MODE]",
    )
    _kv_options.add_kv_router_args(parser)
    parser.add_argument("--namespace", default=env("DYN_NAMESPACE", "dynamo"), help="[DYN_NAMESPACE]")
    parser.add_argument(
        "--request-timeout", type=float, default=env("DYN_REQUEST_TIMEOUT", "300"),
        help="seconds to wait for a worker's next output before 504 [DYN_REQUEST_TIMEOUT]",
    )
    parser.add_argument("--model-cache", default=env("DYN_MODEL_CACHE"), help="where fetched tokenizer files are kept")
    add_discovery_args(parser)
    return parser


async def serve(args: argparse.Namespace) -> int:
    runtime = DistributedRuntime(config=RuntimeConfig(discovery=DiscoveryConfig.from_args(args)))
    mode = ROUTER_MODES[args.router_mode]
    manager = ModelManager(runtime, args.namespace, "round_robin" if mode == "kv" else mode, args.model_cache)

    async def start() -> ModelManager:
        await manager.start()
        return manager

    async def stop() -> None:
        await manager.close()
        await runtime.close()

    app = FrontendApp(start, stop, request_timeout=args.request_timeout)
    if mode == "kv":
        manager.client_wrapper = _kv_router_factory(args, runtime, app.metrics.registry)
    config = uvicorn.Config(
        app, host=args.http_host, port=args.http_port, loop="none", http="httptools",
        lifespan="on", log_level="warning", access_log=False, timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))

    async def serve_http() -> bool:
        try:
            await server.serve()
        except SystemExit:  # uvicorn could not listen or start the app (it logged why)
            return False
        return True

    task = asyncio.create_task(serve_http(), name="uvicorn")
    while not server.started and not task.done():  # noqa: ASYNC110 (uvicorn offers no event)
        await asyncio.sleep(0.02)
    if task.done():
        if not task.result():
            print(f"error: cannot serve HTTP on {args.http_host}:{args.http_port} (why is logged above)",
                  file=sys.stderr)
        return 1
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    print(f"READY http://{host}:{port}", flush=True)
    await task
    return 0


def _kv_router_factory(args: argparse.Namespace, runtime: DistributedRuntime, registry: object) -> Any:
    """``router.kv_router.KvRouterFactory`` with the flags' options, metrics on ``registry``."""
    module = importlib.import_module(KV_ROUTER_MODULE)
    config = module.KvRouterConfig(**_kv_options.kv_router_options(args))
    return module.KvRouterFactory(runtime, config, registry)


def main(argv: Sequence[str] | None = None) -> int:
    setup_logging()
    try:
        args = build_parser().parse_args(argv)
        discovery = DiscoveryConfig.from_args(args)
        if discovery.backend == "static" and discovery.static_file is not None:
            read_static_file(discovery.static_file)  # unreadable: say so now, not as a failed start
        _kv_options.check_kv_router_args(args)
        check_name(args.namespace, "namespace")
        if not 0 <= args.http_port <= 65535:
            raise errors.InvalidArgument(f"--http-port must be 0-65535, got {args.http_port}")
        check_number("--request-timeout", args.request_timeout, positive=True)
    except errors.DynamoError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    try:
        import uvloop

        return uvloop.run(serve(args))
    except ImportError:
        return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
