"""``python -m dynamo_zmq.frontend``: the OpenAI-compatible HTTP entry point.

    python -m dynamo_zmq.frontend [--http-host 127.0.0.1] [--http-port 8000]
        [--router-mode round-robin|random|direct|kv|approx] [--namespace dynamo]
        [--discovery mdns|static] [--static-workers tcp://h:p,...] [--request-timeout S]
        [--idle-timeout S] [--graceful-timeout 30] [--stream-stall-timeout S]
        [--migration-limit N] [--max-body-bytes N] [--body-timeout S]
        [--api-key KEY | --api-key-file F] [--tls-cert-file C --tls-key-file K]
        [--tenant-limits FILE]
        [--disagg-mode conditional|always|never] [--disagg-max-local-prefill-tokens N]
        [--disagg-max-prefill-queue N] [--disagg-prefill-timeout S] [--http-workers N]
        [--session-ttl 300] [--max-sessions 100000] [--lora-placement N]
        [router plugin flags, e.g. --kv-overlap-score-weight 1.0 --router-temperature 0.0]

Every flag but ``--help`` has a ``DYN_*`` variable (``--http-port`` -> ``DYN_HTTP_PORT``). Prints
``READY http://HOST:PORT`` once it accepts connections (with ``--http-workers N`` > 1, once all
N processes sharing the port do: ``_http_workers.py``). Router modes beyond the built-in
``round-robin``, ``random`` and ``direct`` come from plugins (``dynamo_zmq.routers`` entry
points; the ``router`` package adds ``kv`` and ``approx``), which also add their flags.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import uvicorn

from .. import errors, tracing
from ..discovery import DiscoveryConfig, add_discovery_args, read_static_file
from ..llm import (
    BUILTIN_MODES,
    DEFAULT_STALL_TIMEOUT,
    ROUTERS,
    RouterPlugin,
    load_plugin,
    plugin_names,
)
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
from ..transport import warn_unless_own_role
from ._batch_args import add_batch_args, batch_config
from ._batch_runner import BatchRunner
from ._disagg import DisaggConfig, add_disagg_args, disagg_config
from ._http_protocol import header_timeout_protocol
from ._http_security import (
    ApiKeyGuard,
    HttpSecurity,
    add_http_security_args,
    http_security,
    is_loopback,
)
from ._http_workers import WorkerSlot, reuseport_socket, supervise
from ._images import add_media_args, media_from_args
from ._limits import HttpLimits
from ._responses_store import add_responses_args, store_from_args
from ._sessions import add_session_args, session_config
from ._sibling_metrics import SiblingMetrics
from ._tenant_limits import LimitsFile, add_tenant_args, limits_file
from ._tenants import Tenants
from .app import FrontendApp
from .models import ModelManager

log = logging.getLogger("dynamo_zmq.frontend")

#: Seconds past ``--graceful-timeout`` after which uvicorn cancels what is still open (the
#: grace's end has ended every open request by then; this is for a request that ignores it).
_BACKSTOP = 5
#: Seconds the frontend's shutdown (model routers, runtime) may take before it exits anyway.
SHUTDOWN_DEADLINE = 10.0


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
        "--http-workers", type=int, default=env("DYN_HTTP_WORKERS", "1"), metavar="N",
        help="processes serving the HTTP port together (SO_REUSEPORT), each routing on its own; "
             "in kv and approx modes they share their load views (router replica sync) "
             "[DYN_HTTP_WORKERS]",
    )
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
        "--graceful-timeout", type=float, default=env("DYN_GRACEFUL_TIMEOUT", "30"),
        help="on SIGTERM/SIGINT, seconds open requests get to finish; those still open then "
             "end with a retryable 503 (an SSE error event and [DONE] when streaming) "
             "[DYN_GRACEFUL_TIMEOUT]",
    )
    parser.add_argument(
        "--stream-stall-timeout", type=float,
        default=env("DYN_STREAM_STALL_TIMEOUT", str(DEFAULT_STALL_TIMEOUT)),
        help="seconds a started stream may bring nothing (or an unstarted one on a worker that "
             "failed its health check) before it counts as lost and migrates; 0 = off "
             "[DYN_STREAM_STALL_TIMEOUT]",
    )
    parser.add_argument(
        "--migration-limit", type=int, default=env("DYN_MIGRATION_LIMIT", "3"),
        help="how many times a request may move to another worker when the one serving it "
             "dies, hangs or shuts down mid-stream (0 = never; a model's workers may advertise "
             "their own with the worker's --migration-limit) [DYN_MIGRATION_LIMIT]",
    )
    parser.add_argument(
        "--max-body-bytes", type=int, default=env("DYN_HTTP_MAX_BODY_BYTES", str(32 * 2**20)),
        help="largest request body, in bytes; 413 beyond [DYN_HTTP_MAX_BODY_BYTES]",
    )
    parser.add_argument(
        "--body-timeout", type=float, default=env("DYN_HTTP_BODY_TIMEOUT", "30"),
        help="seconds a request's headers may take to arrive, and then its body; 408 and the "
             "connection closed after [DYN_HTTP_BODY_TIMEOUT]",
    )
    parser.add_argument(
        "--lora-placement", type=int, default=env("DYN_LORA_PLACEMENT", "0"), metavar="N",
        help="POST /v1/load_lora_adapter loads an adapter on N of its model's workers (per "
             "disaggregation role; those holding the fewest adapters); 0 = all "
             "[DYN_LORA_PLACEMENT]",
    )
    parser.add_argument("--model-cache", default=env("DYN_MODEL_CACHE"),
                        help="where fetched tokenizer files are kept [DYN_MODEL_CACHE]")
    add_session_args(parser)
    add_responses_args(parser)
    add_media_args(parser)
    add_batch_args(parser)
    add_http_security_args(parser)
    add_tenant_args(parser)
    add_disagg_args(parser)
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


class _Server(uvicorn.Server):
    """uvicorn's server without its own SIGTERM/SIGINT handlers: ``serve`` installs the
    frontend's, which give open requests ``--graceful-timeout`` and then end them."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(
    args: argparse.Namespace,
    plugin: RouterPlugin | None,
    security: HttpSecurity,
    disagg: DisaggConfig | None = None,
    tenant_limits: LimitsFile | None = None,
) -> int:
    keys, exempt, tls = security
    runtime = DistributedRuntime(config=RuntimeConfig(
        discovery=DiscoveryConfig.from_args(args), **auth_from_args(args)
    ))
    warn_unless_own_role("frontend", "workers may refuse its requests and subscriptions")
    app: FrontendApp
    slot = WorkerSlot.from_env()  # one of --http-workers N's children
    siblings: SiblingMetrics | None = None

    async def start() -> ModelManager:
        if siblings is not None:
            await siblings.start()
        manager = ModelManager(runtime, args.namespace, args.router_mode, plugin,
                               args.model_cache, app.metrics.registry, disagg,
                               session_config(args))
        await manager.start()
        return manager

    async def close() -> None:
        if siblings is not None:
            await siblings.close()
        if app.manager is not None:
            await app.manager.close()
        await runtime.close()

    async def stop() -> None:
        # Bounded: a close that never returns must not keep the process alive for ever.
        closing = asyncio.ensure_future(close())
        await asyncio.wait((closing,), timeout=SHUTDOWN_DEADLINE)
        if not closing.done():
            log.error("shutdown did not finish within %gs: exiting anyway", SHUTDOWN_DEADLINE)
            logging.shutdown()
            sys.stderr.flush()
            os._exit(1)
        await closing  # its failure, if any, as before

    app = FrontendApp(
        start, stop, request_timeout=args.request_timeout, idle_timeout=args.idle_timeout,
        migration_limit=args.migration_limit, stall_timeout=args.stream_stall_timeout or None,
        limits=HttpLimits(max_body=args.max_body_bytes, body_timeout=args.body_timeout),
        lora_placement=args.lora_placement,
    )
    app.responses = store_from_args(args)  # per process (each of --http-workers N its own)
    app.media = media_from_args(args)
    if slot is None:  # one process per --batch-dir: not with --http-workers N
        app.batches = BatchRunner(app, app.metrics.registry, batch_config(args))
    if slot is not None:
        siblings = SiblingMetrics(slot, app.metrics.render)
        app.metrics_page = siblings.page
    if tenant_limits is not None:  # each of --http-workers N refills at 1/N of the rates
        app.tenants = Tenants(tenant_limits, keys.enabled, app.metrics.registry,
                              share=1 if slot is None else slot.count)
    asgi: Any = app
    if keys.enabled:
        asgi = ApiKeyGuard(app, keys, exempt, app.metrics.unauthorized.inc)
    elif not is_loopback(args.http_host):
        log.warning("serving HTTP on %s without API keys: anyone who can reach it may use it "
                    "(--api-key or --api-key-file; docs/security.md)", args.http_host)
    asgi = tracing.wrap_asgi(asgi)  # the HTTP span, outside the API-key check
    config = uvicorn.Config(
        asgi, host=args.http_host, port=args.http_port, loop="none",
        http=header_timeout_protocol(args.body_timeout),
        lifespan="on", log_level="warning", access_log=False,
        # Nothing reads the client's address or scheme: no X-Forwarded-* rewriting (a layer
        # every request's every await would pass through).
        proxy_headers=False,
        # a backstop only: the grace's end (``end_open_requests``) ends every open request
        timeout_graceful_shutdown=math.ceil(args.graceful_timeout) + _BACKSTOP,
        ssl_certfile=tls.cert if tls else None, ssl_keyfile=tls.key if tls else None,
        # JSON lines: uvicorn's records go through the root logger's formatter, not its own
        log_config=None if tracing.env_flag("DYN_LOGGING_JSONL") else uvicorn.config.LOGGING_CONFIG,
    )
    server = _Server(config)
    loop = asyncio.get_running_loop()

    def end_open_requests() -> None:
        if ended := app.in_flight.end_all():
            log.warning("graceful timeout (%gs) over: ended %d open requests with a retryable "
                        "503", args.graceful_timeout, ended)

    def on_signal() -> None:
        if server.should_exit:  # a second signal: no more grace
            end_open_requests()
            return
        server.should_exit = True  # uvicorn stops accepting and waits for open requests
        if open_now := len(app.in_flight):
            log.info("shutting down: %d open requests get %gs to finish", open_now,
                     args.graceful_timeout)
        loop.call_later(args.graceful_timeout, end_open_requests)

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, on_signal)

    async def serve_http() -> bool:
        try:
            # a child of --http-workers binds the port its siblings bind too
            sockets = None if slot is None else [reuseport_socket(args.http_host, args.http_port)]
            await server.serve(sockets=sockets)
        except OSError as exc:
            log.error("cannot bind %s:%s: %s", args.http_host, args.http_port, exc)
            return False
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
    print(f"READY {'https' if tls else 'http'}://{host}:{port}", flush=True)
    await task
    if slot is not None:
        slot.remove_if_orphaned()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    setup_logging()
    try:
        args = build_parser().parse_args(argv)
        discovery = DiscoveryConfig.from_args(args)
        if "static" in discovery.backends and discovery.static_file is not None:
            read_static_file(discovery.static_file)  # unreadable: say so now, not as a failed start
        RuntimeConfig(**auth_from_args(args))  # the keys load, or say why now
        plugin = routing_plugin(args)
        security = http_security(args)
        disagg = disagg_config(args)
        tenant_limits = limits_file(args)
        session_config(args)  # the flags can work, or say why now
        store_from_args(args)
        media_from_args(args)
        batch_config(args)
        check_name(args.namespace, "namespace")
        if not 0 <= args.http_port <= 65535:
            raise errors.InvalidArgument(f"--http-port must be 0-65535, got {args.http_port}")
        if args.request_timeout is not None:
            check_number("--request-timeout", args.request_timeout, positive=True)
        check_number("--idle-timeout", args.idle_timeout, positive=True)
        check_number("--graceful-timeout", args.graceful_timeout)
        check_number("--stream-stall-timeout", args.stream_stall_timeout)
        check_number("--body-timeout", args.body_timeout, positive=True)
        if args.max_body_bytes < 1:
            raise errors.InvalidArgument(
                f"--max-body-bytes must be >= 1, got {args.max_body_bytes}"
            )
        if args.migration_limit < 0:
            raise errors.InvalidArgument(
                f"--migration-limit must be >= 0, got {args.migration_limit}"
            )
        if args.lora_placement < 0:
            raise errors.InvalidArgument(
                f"--lora-placement must be >= 0, got {args.lora_placement}"
            )
        if args.http_workers < 1:
            raise errors.InvalidArgument(f"--http-workers must be >= 1, got {args.http_workers}")
    except errors.DynamoError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    if args.http_workers > 1:
        return supervise(sys.argv[1:] if argv is None else argv, args)
    tracing.setup("dynamo-frontend")
    try:
        return run_main(serve(args, plugin, security, disagg, tenant_limits))
    finally:
        tracing.shutdown()


if __name__ == "__main__":
    sys.exit(main())
