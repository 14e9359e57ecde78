"""``python -m dynamo_zmq.frontend``: the OpenAI-compatible HTTP entry point.

    python -m dynamo_zmq.frontend [--http-host 127.0.0.1] [--http-port 8000]
        [--router-mode round-robin|random|direct|kv|approx] [--namespace dynamo]
        [--discovery mdns|static] [--static-workers tcp://h:p,...] [--request-timeout S]
        [--idle-timeout S] [--migration-limit N]
        [router plugin flags, e.g. --kv-overlap-score-weight 1.0 --router-temperature 0.0]

Every flag has a ``DYN_*`` variable (``--http-port`` -> ``DYN_HTTP_PORT``). Prints
``READY http://HOST:PORT`` once it accepts connections. Router modes beyond the built-in
``round-robin``, ``random`` and ``direct`` come from plugins (``dynamo_zmq.routers`` entry
points; the ``router`` package adds ``kv`` and ``approx``), which also add their flags.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence

import uvicorn

from .. import errors
from ..discovery import DiscoveryConfig, add_discovery_args, read_static_file
from ..llm import BUILTIN_MODES, ROUTERS, RouterPlugin, load_plugin, plugin_names
from ..runtime import (
    DistributedRuntime,
    RuntimeConfig,
    add_auth_args,
    auth_from_args,
    check_name,
    check_number,
    run_main,
    setup_logging,
)
from .app import FrontendApp
from .models import ModelManager

log = logging.getLogger("dynamo_zmq.frontend")


def router_modes() -> list[str]:
    """The ``--router-mode`` choices: the built-in modes, then every installed plugin's."""
    return [*BUILTIN_MODES, *(m for m in plugin_names(ROUTERS) if m not in BUILTIN_MODES)]


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    parser = argparse.ArgumentParser(
        prog="python -m dynamo_zmq.frontend", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--http-host", default=env("DYN_HTTP_HOST", "127.0.0.1"),
                        help="[DYN_HTTP_HOST]")
    parser.add_argument("--http-port", type=int, default=env("DYN_HTTP_PORT", "8000"),
                        help="0 = any [DYN_HTTP_PORT]")
    parser.add_argument(
        "--router-mode", choices=router_modes(), default=env("DYN_ROUTER_MODE", "round-robin"),
        help="direct: each request names its instance in the x-worker-instance-id header "
             "[DYN_ROUTER_MODE]",
    )
    parser.add_argument(
        "--namespace", default=env("DYN_NAMESPACE", "dynamo"), help="[DYN_NAMESPACE]"
    )
    parser.add_argument(
        "--request-timeout", type=float, default=env("DYN_REQUEST_TIMEOUT"),
        help="seconds a whole request may take, then 504 and the worker's context is stopped "
             "(default: no deadline; a request's x-dynamo-request-timeout header may ask for "
             "less) [DYN_REQUEST_TIMEOUT]",
    )
    parser.add_argument(
        "--idle-timeout", type=float, default=env("DYN_IDLE_TIMEOUT", "300"),
        help="seconds to wait for a worker's next output before 504 [DYN_IDLE_TIMEOUT]",
    )
    parser.add_argument(
        "--migration-limit", type=int, default=env("DYN_MIGRATION_LIMIT", "3"),
        help="how many times a request may move to another worker when the one serving it "
             "dies, hangs or shuts down mid-stream (0 = never; a model's workers may advertise "
             "their own with the worker's --migration-limit) [DYN_MIGRATION_LIMIT]",
    )
    parser.add_argument("--model-cache", default=env("DYN_MODEL_CACHE"),
                        help="where fetched tokenizer files are kept [DYN_MODEL_CACHE]")
    add_discovery_args(parser)
    add_auth_args(parser)
    modes_of: dict[type[RouterPlugin], list[str]] = {}
    for mode in plugin_names(ROUTERS):
        try:
            modes_of.setdefault(load_plugin(ROUTERS, mode), []).append(mode)
        except errors.InvalidArgument as exc:  # a broken plugin must not break the frontend
            log.warning("router mode %r unavailable: %s", mode, exc.message)
    for plugin, modes in modes_of.items():
        plugin.add_args(parser.add_argument_group(f"router modes {', '.join(modes)}"))
    return parser


def routing_plugin(args: argparse.Namespace) -> RouterPlugin | None:
    """The configured plugin of a plugin router mode (None for a built-in mode).

    Raises:
        InvalidArgument: the plugin's flags cannot work.
    """
    if args.router_mode in BUILTIN_MODES:
        return None
    plugin_class: type[RouterPlugin] = load_plugin(ROUTERS, args.router_mode)
    return plugin_class.from_args(args.router_mode, args)


async def serve(args: argparse.Namespace, plugin: RouterPlugin | None) -> int:
    runtime = DistributedRuntime(config=RuntimeConfig(
        discovery=DiscoveryConfig.from_args(args), **auth_from_args(args)
    ))
    app: FrontendApp

    async def start() -> ModelManager:
        manager = ModelManager(runtime, args.namespace, args.router_mode, plugin,
                               args.model_cache, app.metrics.registry)
        await manager.start()
        return manager

    async def stop() -> None:
        if app.manager is not None:
            await app.manager.close()
        await runtime.close()

    app = FrontendApp(
        start, stop, request_timeout=args.request_timeout, idle_timeout=args.idle_timeout,
        migration_limit=args.migration_limit,
    )
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
            print(f"error: cannot serve HTTP on {args.http_host}:{args.http_port} "
                  "(why is logged above)", file=sys.stderr)
        return 1
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    print(f"READY http://{host}:{port}", flush=True)
    await task
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    setup_logging()
    try:
        args = build_parser().parse_args(argv)
        discovery = DiscoveryConfig.from_args(args)
        if discovery.backend == "static" and discovery.static_file is not None:
            read_static_file(discovery.static_file)  # unreadable: say so now, not as a failed start
        RuntimeConfig(**auth_from_args(args))  # the keys load, or say why now
        plugin = routing_plugin(args)
        check_name(args.namespace, "namespace")
        if not 0 <= args.http_port <= 65535:
            raise errors.InvalidArgument(f"--http-port must be 0-65535, got {args.http_port}")
        if args.request_timeout is not None:
            check_number("--request-timeout", args.request_timeout, positive=True)
        check_number("--idle-timeout", args.idle_timeout, positive=True)
        if args.migration_limit < 0:
            raise errors.InvalidArgument(
                f"--migration-limit must be >= 0, got {args.migration_limit}"
            )
    except errors.DynamoError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    return run_main(serve(args, plugin))


if __name__ == "__main__":
    sys.exit(main())
