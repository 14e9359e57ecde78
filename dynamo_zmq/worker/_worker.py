"""``python -m dynamo_zmq.worker``: serve one engine on the request plane.

    python -m dynamo_zmq.worker --engine mocker --model-path DIR [--model-name NAME]
        [--namespace dynamo] [--component backend] [--endpoint generate]
        [--host H] [--port P] [--discovery mdns|static] [--disaggregation-mode agg|prefill|decode]
        [--metrics-port P] [--load-interval 0.1] [--load-port P] [engine flags...]

Every flag has a ``DYN_*`` environment variable (``--model-path`` -> ``DYN_MODEL_PATH``).
Engines are found by name in the ``dynamo_zmq.engines`` entry-point group, or as
``MODULE:CLASS``. Once serving, the worker prints ``READY <address> <instance id hex>``.

Shutdown (SIGTERM/SIGINT): unregister -> grace period -> stop admitting (EngineShutdown) ->
drain in-flight requests -> engine.drain() -> engine.cleanup() -> close sockets -> exit 0.
A second signal skips the waiting.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import importlib.metadata
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
from tokenizers import Tokenizer

from .. import errors
from ..context import Context
from ..llm import (
    CHUNK,
    MAX_LOAD_INTERVAL,
    EngineConfig,
    FinishReason,
    LLMEngine,
    LLMEngineOutput,
    ModelCard,
    PreprocessedRequest,
    StopConditions,
    build_card,
    postprocess,
    read_card_file,
    validate_stream,
)
from ..runtime import (
    DistributedRuntime,
    RuntimeConfig,
    StatusServer,
    add_runtime_args,
    check_name,
    setup_logging,
)
from ._load_publisher import LoadPublisher
from ._metrics import WorkerMetrics

__all__ = ["ENGINE_GROUP", "Worker", "build_parser", "load_engine_class", "main"]

log = logging.getLogger("dynamo_zmq.worker")

ENGINE_GROUP = "dynamo_zmq.engines"


def _env(name: str, default: Any = None) -> Any:
    return os.environ.get(f"DYN_{name}", default)


def load_engine_class(spec: str) -> type[LLMEngine]:
    """``NAME`` from the entry-point group, or ``package.module:Class``."""
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise errors.InvalidArgument(f"cannot load engine {spec!r}: {exc}") from exc
    else:
        found = {ep.name: ep for ep in importlib.metadata.entry_points(group=ENGINE_GROUP)}
        if spec not in found:
            known = ", ".join(sorted(found)) or "none installed"
            raise errors.InvalidArgument(f"unknown engine {spec!r} (known: {known}; or use MODULE:CLASS)")
        cls = found[spec].load()
    if not (isinstance(cls, type) and issubclass(cls, LLMEngine)):
        raise errors.InvalidArgument(f"engine {spec!r} is not an LLMEngine subclass")
    return cls


def build_parser(engine_cls: type[LLMEngine] | None = None, add_help: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dynamo_zmq.worker", description="Serve an LLM engine on the dynamo-zmq request plane.",
        add_help=add_help,
    )
    parser.add_argument("--engine", default=_env("ENGINE", "mocker"), help="engine name or MODULE:CLASS [DYN_ENGINE]")
    parser.add_argument("--model-path", default=_env("MODEL_PATH"), help="model directory [DYN_MODEL_PATH]")
    parser.add_argument("--model-name", default=_env("MODEL_NAME"), help="served model name [DYN_MODEL_NAME]")
    parser.add_argument("--namespace", default=_env("NAMESPACE", "dynamo"), help="[DYN_NAMESPACE]")
    parser.add_argument("--component", default=_env("COMPONENT", "backend"), help="[DYN_COMPONENT]")
    parser.add_argument("--endpoint", default=_env("ENDPOINT", "generate"), help="[DYN_ENDPOINT]")
    parser.add_argument(
        "--disaggregation-mode", choices=["agg", "prefill", "decode"],
        default=_env("DISAGGREGATION_MODE", "agg"), help="[DYN_DISAGGREGATION_MODE]",
    )
    parser.add_argument(
        "--metrics-port", type=int, default=_env("METRICS_PORT"),
        help="serve /metrics, /health, /live on this port (0 = any) [DYN_METRICS_PORT]",
    )
    parser.add_argument(
        "--health-check-interval", type=float, default=_env("HEALTH_CHECK_INTERVAL", "10.0"),
        help="run a 1-token canary after this many idle seconds [DYN_HEALTH_CHECK_INTERVAL]",
    )
    parser.add_argument(
        "--grace-period", type=float, default=_env("GRACE_PERIOD", "0.5"),
        help="seconds between unregistering and refusing new requests [DYN_GRACE_PERIOD]",
    )
    parser.add_argument(
        "--graceful-timeout", type=float, default=_env("GRACEFUL_TIMEOUT", "30.0"),
        help="seconds to wait for in-flight requests on shutdown [DYN_GRACEFUL_TIMEOUT]",
    )
    parser.add_argument(
        "--load-interval", type=float, default=_env("LOAD_INTERVAL", "0.1"),
        help=f"publish the engine's load for KV routers every this many seconds, 0 = never, at most "
             f"{MAX_LOAD_INTERVAL:g} (engines without load() publish nothing) [DYN_LOAD_INTERVAL]",
    )
    parser.add_argument(
        "--load-port", type=int, default=_env("LOAD_PORT", "0"),
        help="port of the load PUB socket, 0 = any [DYN_LOAD_PORT]",
    )
    parser.add_argument(
        "--debug-streams", action="store_true", default=_env("DEBUG_STREAMS", "") == "1",
        help="validate every engine stream (one terminal, last) [DYN_DEBUG_STREAMS=1]",
    )
    add_runtime_args(parser)
    if engine_cls is not None:
        group = parser.add_argument_group(f"{engine_cls.name or engine_cls.__name__} engine")
        engine_cls.add_args(group)  # type: ignore[arg-type]
    return parser


class Worker:
    """Owns one engine and serves it: registration, admission, cancellation, post-processing
    (text and stop strings, see ``postprocess``), health, metrics."""

    def __init__(self, engine: LLMEngine, args: argparse.Namespace) -> None:
        self.engine = engine
        self.args = args
        rc = RuntimeConfig.from_args(args)
        self.runtime = DistributedRuntime(
            config=RuntimeConfig(
                discovery=rc.discovery, host=rc.host, port=rc.port,
                graceful_timeout=args.graceful_timeout, grace_period=args.grace_period,
            )
        )
        self.config: EngineConfig | None = None
        self.card: ModelCard | None = None
        #: The model's tokenizer, for post-processing (detokenization, stop strings); None
        #: without a tokenizer.json, and then chunks pass through as the engine made them.
        self.tokenizer: Tokenizer | None = None
        self.metrics: WorkerMetrics | None = None
        self.status: StatusServer | None = None
        self.load_publisher: LoadPublisher | None = None
        self.healthy = False
        self.health_detail: dict[str, Any] = {"status": "starting"}
        self._last_activity = time.monotonic()
        self._inflight = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._force = asyncio.Event()

    # -- lifecycle -------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._on_signal)
        try:
            await self._start()
        except Exception as exc:
            log.error("worker failed to start: %s", exc, exc_info=not isinstance(exc, errors.DynamoError))
            await self._close()
            return 1
        print(f"READY {self.runtime.address} {self.runtime.instance_id:x}", flush=True)
        await self.runtime.wait_shutdown()
        log.info("shutting down: unregister, grace period, drain")
        drain = asyncio.create_task(self.runtime.drain(), name="worker-drain")
        force = asyncio.create_task(self._force.wait(), name="worker-force")
        await asyncio.wait({drain, force}, return_when=asyncio.FIRST_COMPLETED)
        force.cancel()
        if not drain.done():
            log.warning("second signal: not waiting for in-flight requests")
            drain.cancel()
        with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
            await asyncio.wait_for(self.engine.drain(), None if not self._force.is_set() else 1.0)
        await self._close()
        log.info("worker stopped")
        return 0

    def _on_signal(self) -> None:
        if self.runtime.is_shutdown():
            self._force.set()
        self.runtime.shutdown()

    async def _start(self) -> None:
        args = self.args
        self.config = config = await self.engine.start(self.runtime.instance_id)
        if not config.model_name:
            raise errors.InvalidArgument("engine reported an empty model name")
        name = args.model_name or config.served_model_name or config.model_name
        if args.model_path is None:
            raise errors.InvalidArgument("--model-path (DYN_MODEL_PATH) is required")
        self.card = build_card(
            args.model_path, name, context_length=config.context_length,
            kv_block_size=config.kv_block_size, role=args.disaggregation_mode,
        )
        tokenizer_file = Path(args.model_path) / "tokenizer.json"
        if tokenizer_file.is_file():
            self.tokenizer = await asyncio.to_thread(Tokenizer.from_file, str(tokenizer_file))
        else:
            log.info("no tokenizer.json in %s: no detokenization or stop strings", args.model_path)
        self.metrics = WorkerMetrics(name)
        self._model_metrics = self.metrics.for_model()
        if args.metrics_port is not None:
            self.status = StatusServer(
                self.runtime.config.bind_host if self.runtime.config.host else "0.0.0.0",
                int(args.metrics_port), self._render_metrics, self._health,
            )
            self.status.start()
            log.info("metrics and health on port %d", self.status.port)
        component = self.runtime.namespace(args.namespace).component(args.component)
        metadata = {
            "model_card": msgspec.to_builtins(self.card),
            "engine": msgspec.to_builtins(config),
        }
        load_endpoint = await self._start_load_publisher()
        if load_endpoint is not None:
            metadata["load_endpoint"] = load_endpoint
        await component.endpoint("model_files").start_serving(self._model_files)
        await component.endpoint(args.endpoint).start_serving(
            self._generate, metadata=metadata, request_type=PreprocessedRequest
        )
        await self._canary()
        self._spawn(self._health_loop(), "worker-health")

    async def _start_load_publisher(self) -> str | None:
        """Bind the load PUB socket if the engine reports load; returns the endpoint to
        advertise (None: nothing is published)."""
        interval = self.args.load_interval
        if not interval or interval <= 0:
            return None
        try:
            if self.engine.load() is None:
                return None
        except Exception:
            log.exception("engine load() failed at start: not publishing load")
            return None
        rc = self.runtime.config
        self.load_publisher = LoadPublisher(
            self.engine.load, self.runtime.instance_id, f"tcp://{rc.bind_host}:{self.args.load_port}", interval
        )
        await self.load_publisher.start()
        endpoint = f"tcp://{rc.advertised_hosts()[0]}:{self.load_publisher.port}"
        log.info("publishing load every %g s on %s", interval, endpoint)
        return endpoint

    async def _close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        if self.load_publisher is not None:  # before cleanup: it reads the engine
            await self.load_publisher.close()
        with contextlib.suppress(Exception):
            await self.engine.cleanup()
        if self.status is not None:
            self.status.close()
        await self.runtime.close()

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- serving ---------------------------------------------------------------------------

    async def _generate(self, request: PreprocessedRequest, ctx: Context) -> AsyncIterator[LLMEngineOutput]:
        assert self.metrics is not None
        m = self._model_metrics
        m.requests.inc()
        m.inflight.inc()
        self._inflight += 1
        aborted = False
        # The engine's own context follows the request's, and a stop string can stop it alone.
        engine_ctx = Context(ctx.id())
        ctx.link_child(engine_ctx)

        def abort(cancelled: bool) -> None:
            nonlocal aborted
            if not aborted:
                aborted = True
                if cancelled:  # the client stopped or killed the request
                    m.cancellations.inc()
                self._spawn(self.engine.abort(engine_ctx), f"abort-{ctx.id()}")

        async def stop_engine() -> None:  # a stop string matched: not a cancellation
            engine_ctx.stop()
            abort(cancelled=False)

        remove = ctx.add_listener(lambda killed: abort(cancelled=True))
        stream = self.engine.generate(request, engine_ctx)
        if self.args.debug_streams:
            stream = validate_stream(stream)
        if self.tokenizer is not None or request.output.detokenize:
            stream = postprocess(stream, request, self.tokenizer, stop_engine)
        start = last = time.monotonic()
        tokens = 0
        try:
            async for out in stream:
                if out.token_ids:
                    now = time.monotonic()
                    if tokens:
                        m.itl.observe(now - last)
                    else:
                        m.ttft.observe(now - start)
                    tokens += len(out.token_ids)
                    last = now
                if out.finish_reason == FinishReason.ERROR:
                    m.engine_errors.inc()
                yield out
        except Exception as exc:
            self.metrics.errors.labels(self.metrics.model, errors.from_exception(exc).kind).inc()
            raise
        finally:
            m.output_tokens.inc(tokens)
            remove()
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(BaseException):
                    await aclose()
            m.inflight.dec()
            self._inflight -= 1
            self._last_activity = time.monotonic()

    async def _model_files(self, request: dict[str, Any]) -> AsyncIterator[bytes]:
        """Stream one file the model card lists: ``{"name": "tokenizer.json"}``."""
        assert self.card is not None
        name = request.get("name") if isinstance(request, dict) else None
        if not isinstance(name, str):
            raise errors.InvalidArgument('model_files expects {"name": FILE}')
        try:
            data = await asyncio.to_thread(read_card_file, self.args.model_path, self.card, name)
        except ValueError as exc:
            raise errors.InvalidArgument(str(exc)) from exc
        for offset in range(0, len(data), CHUNK):
            yield data[offset : offset + CHUNK]

    # -- health ----------------------------------------------------------------------------

    async def _canary(self) -> None:
        """Generate one token on the engine directly; the result sets ``healthy``."""
        request = PreprocessedRequest(token_ids=[1], stop=StopConditions(max_tokens=1, ignore_eos=True))
        ctx = Context(f"health-{time.monotonic_ns()}")
        started = time.monotonic()
        try:
            async def one() -> LLMEngineOutput | None:
                last = None
                async for out in self.engine.generate(request, ctx):
                    last = out
                return last

            out = await asyncio.wait_for(one(), 30)
            ok = out is not None and out.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
            detail = {"status": "healthy" if ok else "unhealthy", "finish_reason": out and out.finish_reason}
        except Exception as exc:
            ok, detail = False, {"status": "unhealthy", "error": f"{type(exc).__name__}: {exc}"}
        detail["canary_seconds"] = round(time.monotonic() - started, 4)
        if ok != self.healthy:
            log.log(logging.INFO if ok else logging.WARNING, "health canary: %s", detail)
        self.healthy, self.health_detail = ok, detail
        if self.metrics is not None:
            self.metrics.healthy.labels(self.metrics.model).set(1 if ok else 0)

    async def _health_loop(self) -> None:
        interval = self.args.health_check_interval
        while True:
            await asyncio.sleep(min(1.0, interval))
            self._refresh_stats()
            idle = time.monotonic() - self._last_activity
            if self._inflight == 0 and idle >= interval:
                await self._canary()
                self._last_activity = time.monotonic()

    def _refresh_stats(self) -> None:
        if self.metrics is None:
            return
        stats = self.engine.stats()
        active, total = stats.get("kv_active_blocks"), stats.get("kv_total_blocks")
        if active is not None:
            self.metrics.kv_active.labels(self.metrics.model).set(active)
            if total:
                self.metrics.kv_usage.labels(self.metrics.model).set(active / total)

    def _health(self) -> tuple[bool, dict[str, Any]]:
        return self.healthy and not self.runtime.is_shutdown(), dict(self.health_detail)

    def _render_metrics(self) -> bytes:
        assert self.metrics is not None
        return self.metrics.render()


def parse_args(argv: Sequence[str] | None = None) -> tuple[type[LLMEngine], argparse.Namespace]:
    """Two passes: find ``--engine``, then parse with that engine's own flags added."""
    pre, _ = build_parser(add_help=False).parse_known_args(argv)  # --help waits for the engine's flags
    engine_cls = load_engine_class(pre.engine)
    args = build_parser(engine_cls).parse_args(argv)
    for what in ("namespace", "component", "endpoint"):
        check_name(getattr(args, what), what)
    if args.model_path is not None and not Path(args.model_path).is_dir():
        raise errors.InvalidArgument(f"--model-path {args.model_path!r} is not a directory")
    if not 0 <= args.load_interval <= MAX_LOAD_INTERVAL:
        raise errors.InvalidArgument(
            f"--load-interval must be 0 (never) or up to {MAX_LOAD_INTERVAL:g} s, got {args.load_interval:g}"
        )
    return engine_cls, args


def main(argv: Sequence[str] | None = None) -> int:
    setup_logging()
    try:
        engine_cls, args = parse_args(argv)
        engine = engine_cls.from_args(args)
    except errors.DynamoError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    return asyncio.run(Worker(engine, args).run())

