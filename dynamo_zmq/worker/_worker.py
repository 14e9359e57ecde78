"""``Worker``: owns one engine and serves it on the request plane.

Start: ``engine.start`` -> model card -> metrics -> KV transfer of a prefill or decode worker
(``_kv_transfer.py``) -> ``ModelAdvert`` and system status server ->
load publisher -> ``model_files``, ``clear_kv_blocks``, ``load_lora``, ``unload_lora`` and
generate endpoints -> health canary
-> ``READY``. The generate endpoint also serves embedding requests (``request.embedding`` set:
``engine.embed``, see ``_embed.py``). While the canary fails, the generate endpoint is
withdrawn from routing. An engine that fails to start is reported as ``EngineShutdown`` (one
line) and the process exits 1.

Shutdown (SIGTERM/SIGINT), the backend-common document's order: unregister -> grace period ->
stop admitting (EngineShutdown) -> ``engine.drain()`` while in-flight requests still run -> wait
for them (within the graceful timeout) -> hand over what still runs -> ``engine.cleanup()`` ->
close sockets -> exit 0. A second signal skips the waiting, not the hand-over. Handing over ends
each request still running with a retryable ``EngineShutdown`` after the outputs it already
sent (the engine aborts it), so its caller moves it to another worker: never ``cancelled``,
never a socket that just closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
from tokenizers import Tokenizer

from .. import errors
from ..context import Context
from ..llm import (
    Capability,
    EngineConfig,
    FinishReason,
    LLMEngine,
    LLMEngineOutput,
    ModelAdvert,
    ModelCard,
    PreprocessedRequest,
    build_card,
)
from ..llm.parsers import detect_parsers
from ..resources import cancel_and_wait
from ..runtime import DistributedRuntime, StatusServer
from ..transport import WORKER, WORKER_CALLERS, warn_unless_own_role
from ._config import WorkerConfig
from ._embed import serve_embedding
from ._health import Health, embedding_payload
from ._kv_transfer import start_kv_transfer
from ._load_publisher import LoadPublisher
from ._metrics import ModelMetrics, WorkerMetrics
from ._request import Accounting, EngineContext, admit, engine_stream
from ._side_endpoints import SideEndpoints

__all__ = ["Worker"]

log = logging.getLogger("dynamo_zmq.worker")


class Worker:
    """Owns one engine and serves it: registration, admission, cancellation, post-processing
    (text and stop strings, see ``postprocess``), health, metrics, load reports. A request
    preprocessed for another model card (its ``mdcsum``) is refused with InvalidArgument.

    Args:
        engine: the engine (not started yet).
        settings: the worker's settings (``WorkerConfig``, e.g. from ``from_args``).
    """

    def __init__(self, engine: LLMEngine, settings: WorkerConfig) -> None:
        self.engine = engine
        self.settings = settings
        self.runtime = DistributedRuntime(config=settings.runtime)
        warn_unless_own_role(WORKER, "frontends and routers will not route to it")
        self._res = self.runtime.resources.child("worker")
        self.config: EngineConfig | None = None
        self.card: ModelCard | None = None
        #: The model's tokenizer, for post-processing (detokenization, stop strings); None
        #: without a tokenizer.json, and then chunks pass through as the engine made them.
        self.tokenizer: Tokenizer | None = None
        #: The parsers' names (``llm.parsers``): the flags, else the chat template's.
        self.tool_parser: str | None = None
        self.reasoning_parser: str | None = None
        self.metrics: WorkerMetrics | None = None
        self.health: Health | None = None
        self.status: StatusServer | None = None
        self.load_publisher: LoadPublisher | None = None
        self._model_metrics: ModelMetrics | None = None
        self._force = asyncio.Event()
        self._advert: ModelAdvert | None = None
        self._generate_path = ""
        self._handing_over = False  # kills from now on are hand-overs, not cancellations

    # -- lifecycle -------------------------------------------------------------------------

    async def run(self, *, signals: bool = True) -> int:
        """Start, serve until shut down, stop in order; returns the exit status (1: the start
        failed). ``signals``: install the SIGTERM/SIGINT handlers (``on_signal``) itself."""
        if signals:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, self.on_signal)
        try:
            await self._start()
        except Exception as exc:
            err = errors.from_exception(exc)
            log.error("worker failed to start: %s: %s", err.kind, err.message,
                      exc_info=not isinstance(exc, errors.DynamoError))
            await self._close()
            return 1
        print(f"READY {self.runtime.address} {self.runtime.instance_id:x}", flush=True)
        await self.runtime.wait_shutdown()
        shutdown = self._res.spawn(self._shut_down(), "worker-shutdown")
        force = self._res.spawn(self._force.wait(), "worker-force")
        await asyncio.wait({shutdown, force}, return_when=asyncio.FIRST_COMPLETED)
        if not shutdown.done():
            log.warning("second signal: not waiting for the engine or in-flight requests")
        await cancel_and_wait((shutdown, force))
        await self._hand_over()
        await self._close()
        log.info("worker stopped")
        return 0

    async def _shut_down(self) -> None:
        """Unregister, grace period, stop admitting; then ``engine.drain()`` with the in-flight
        requests still running, and wait for them, both within the graceful timeout."""
        log.info("shutting down: unregistering, grace period %gs",
                 self.runtime.config.grace_period)
        await self.runtime.stop_admitting()
        log.info("grace period over: refusing new requests; engine drain with %d in flight",
                 self.runtime.inflight)
        try:
            async with asyncio.timeout(self.runtime.config.graceful_timeout):
                await self._drain()
        except TimeoutError:
            log.warning("graceful timeout (%gs) over with %d requests in flight",
                        self.runtime.config.graceful_timeout, self.runtime.inflight)

    async def _drain(self) -> None:
        await self.engine.drain()
        await self.runtime.wait_idle(None)
        log.info("engine drained, no request in flight")

    async def _hand_over(self) -> None:
        """End the requests still running with a retryable ``EngineShutdown`` (after their
        outputs; the engine aborts them) and wait for those terminals to go out, before the
        engine and the sockets close."""
        if not self.runtime.inflight:
            return
        self._handing_over = True
        iid = self.runtime.instance_id
        handed = await self.runtime.hand_over(
            f"worker {iid:x} is shutting down: the request is handed over to another worker"
        )
        log.warning("handed over %d requests still in flight (EngineShutdown, retryable)",
                    handed)

    def on_signal(self) -> None:
        """SIGTERM/SIGINT: shut down in order; a second one skips the waiting."""
        if self.runtime.is_shutdown():
            self._force.set()
        self.runtime.shutdown()

    async def _start_engine(self) -> EngineConfig:
        """``engine.start``; any failure is the engine's: ``EngineShutdown``."""
        try:
            return await self.engine.start(self.runtime.instance_id)
        except errors.EngineShutdown:
            raise
        except Exception as exc:
            log.debug("engine start failed", exc_info=exc)
            what = self.engine.name or type(self.engine).__name__
            reason = exc.message if isinstance(exc, errors.DynamoError) else (
                f"{type(exc).__name__}: {exc}"
            )
            raise errors.EngineShutdown(f"the {what} engine failed to start: {reason}") from exc

    async def _start(self) -> None:
        args = self.settings
        if args.model_path is None:
            raise errors.InvalidArgument("--model-path (DYN_MODEL_PATH) is required")
        self.config = config = await self._start_engine()
        if not config.model_name:
            raise errors.InvalidArgument("engine reported an empty model name")
        name = args.model_name or config.served_model_name or config.model_name
        self.card = build_card(
            args.model_path, name, context_length=config.context_length,
            kv_block_size=config.kv_block_size, role=args.disaggregation_mode,
        )
        tokenizer_file = Path(args.model_path) / "tokenizer.json"
        if tokenizer_file.is_file():
            self.tokenizer = await asyncio.to_thread(Tokenizer.from_file, str(tokenizer_file))
        else:
            log.info("no tokenizer.json in %s: no detokenization or stop strings", args.model_path)
        self.tool_parser, self.reasoning_parser = args.tool_call_parser, args.reasoning_parser
        if self.tool_parser is None or self.reasoning_parser is None:
            tool, reasoning = detect_parsers(args.model_path)
            self.tool_parser = self.tool_parser or tool
            self.reasoning_parser = self.reasoning_parser or reasoning
        self.metrics = metrics = WorkerMetrics(name, args.namespace, args.component, args.endpoint)
        self._model_metrics = metrics.for_model()
        await start_kv_transfer(self.engine, self.settings, self.runtime.config, metrics,
                                self._res)
        engine_metrics = self.engine.metrics_collector()
        if engine_metrics is not None:
            metrics.register_engine(engine_metrics)
        component = self.runtime.namespace(args.namespace).component(args.component)
        generate = component.endpoint(args.endpoint)
        payload = args.health_check_payload
        if payload is None and Capability.EMBEDDINGS_ONLY in self.engine.capabilities():
            payload = embedding_payload()  # the engine cannot generate: the canary embeds
        self.health = Health(
            self.engine, metrics, args.health_check_interval, payload,
            on_change=lambda ok: self.runtime.set_endpoint_health(generate.path, ok),
        )
        if args.system_port is not None:
            self.status = StatusServer(
                args.system_host, int(args.system_port), metrics.render, self._health,
            )
            self.status.start()
            log.info("system port on %s (--system-host): metrics and health on port %d",
                     args.system_host, self.status.port)
        engine = self.engine
        advert = ModelAdvert(
            self.card, config, await self._start_load_publisher(), args.migration_limit,
            engine_name=engine.name or type(engine).__name__,
            capabilities=sorted(engine.capabilities()),
            tool_call_parser=self.tool_parser, reasoning_parser=self.reasoning_parser,
            lora_adapters=dict(engine.lora_adapters()),
        )
        self._advert, self._generate_path = advert, generate.path
        side = SideEndpoints(engine, args.model_path, self.card, self._readvertise)
        # With auth on, only frontends' and workers' keys may call a worker (docs/security.md).
        await component.endpoint("model_files").start_serving(
            side.model_files, callers=WORKER_CALLERS)
        await component.endpoint("clear_kv_blocks").start_serving(
            side.clear_kv_blocks, callers=WORKER_CALLERS)
        for name, handler in (("load_lora", side.load_lora), ("unload_lora", side.unload_lora)):
            await component.endpoint(name).start_serving(handler, callers=WORKER_CALLERS)
        await generate.start_serving(
            self._generate, metadata=advert.to_metadata(), request_type=PreprocessedRequest,
            callers=WORKER_CALLERS,
        )
        await self.health.canary()
        self._res.spawn(self.health.run(), "worker-health")

    def _readvertise(self) -> None:
        """Advertise the engine's LoRA adapters as they are now (after a load or unload)."""
        assert self._advert is not None
        self._advert = msgspec.structs.replace(
            self._advert, lora_adapters=dict(self.engine.lora_adapters()))
        self.runtime.set_endpoint_metadata(self._generate_path, self._advert.to_metadata())

    async def _start_load_publisher(self) -> str | None:
        """Bind the load PUB socket if the engine reports load; returns the endpoint to
        advertise (None: nothing is published)."""
        interval = self.settings.load_interval
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
            self.engine.load, self.runtime.instance_id,
            f"tcp://{rc.bind_host}:{self.settings.load_port}", interval, resources=self._res,
        )
        await self.load_publisher.start()
        endpoint = f"tcp://{rc.advertised_hosts()[0]}:{self.load_publisher.port}"
        log.info("publishing load every %g s on %s", interval, endpoint)
        return endpoint

    async def _close(self) -> None:
        await self._res.close()  # health loop, pending aborts, and the load publisher
        with contextlib.suppress(Exception):
            await self.engine.cleanup()
        if self.status is not None:
            self.status.close()
        await self.runtime.close()

    # -- serving ---------------------------------------------------------------------------

    def _generate(
        self, request: PreprocessedRequest, ctx: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        """The generate endpoint: admit the request, then embed it or run the engine on it
        (a plain function: the stream the server iterates is ``_embed``'s or ``_run``'s)."""
        assert self.card is not None
        admit(request, self.card)
        lora = request.lora_name
        if lora is not None and lora not in self.engine.lora_adapters():
            raise errors.NotFound(f"this worker holds no LoRA adapter {lora!r}")
        if request.embedding is not None:  # /v1/embeddings, routed as a generation is
            return self._embed(request, ctx)
        return self._run(request, ctx)

    async def _embed(
        self, request: PreprocessedRequest, ctx: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        assert self.metrics is not None and self._model_metrics is not None
        assert self.health is not None
        try:
            async for out in serve_embedding(
                self.engine, request, ctx, self._model_metrics, self.health,
                lambda c: self._res.spawn(self.engine.abort(c), f"abort-{c.id()}"),
            ):
                yield out
        except Exception as exc:
            self.metrics.error(errors.from_exception(exc).kind).inc()
            raise

    async def _run(
        self, request: PreprocessedRequest, ctx: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        """Run the engine on ``request``: its outputs, post-processed, accounted for."""
        assert self.metrics is not None and self._model_metrics is not None
        assert self.health is not None
        m = self._model_metrics
        account = Accounting(m, self.health)
        engine = EngineContext(self.engine, ctx, self._res.spawn, m.cancellations.inc,
                               lambda: self._handing_over)
        stream, proc, link = engine_stream(
            self.engine, request, engine.ctx, ctx, tokenizer=self.tokenizer,
            tool_parser=self.tool_parser, reasoning_parser=self.reasoning_parser,
            debug=self.settings.debug_streams, role=self.settings.disaggregation_mode,
        )
        output = account.output
        process = None if proc is None else proc.process
        try:
            async for raw in stream:  # once per token: the common chunk takes the first branch
                out = raw if process is None else process(raw)
                if out.token_ids:
                    output(out, link)
                finish = out.finish_reason
                if finish is None:
                    yield out
                    continue
                if proc is not None and proc.stopped_by_string and raw.finish_reason is None:
                    engine.stop()  # a stop string ended it: free the engine's sequence
                if finish == FinishReason.ERROR:
                    m.engine_errors.inc()
                    if (reason := self.engine.dead_reason()) is not None:
                        raise errors.EngineShutdown(f"the engine died: {reason}")
                yield out
                if proc is not None:
                    return  # the engine's stream is not read further (closed below)
            if proc is not None:  # the engine's stream ended without a terminal
                m.engine_errors.inc()
                yield proc.missing_terminal()
        except Exception as exc:
            died = self._engine_death(exc)
            kind = (died or errors.from_exception(exc)).kind
            self.metrics.error(kind).inc()
            if died is None:
                raise
            raise died from exc
        finally:
            account.end()
            engine.close()
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:
                    log.exception("closing the engine stream of request %s failed", ctx.id())

    def _engine_death(self, exc: Exception) -> errors.EngineShutdown | None:
        """``EngineShutdown`` for a ``generate`` that failed untyped (a plain exception or
        ``Unknown``) after the engine declared itself dead; None: ``exc`` goes out as it is."""
        if isinstance(exc, errors.DynamoError) and not isinstance(exc, errors.Unknown):
            return None
        reason = self.engine.dead_reason()
        return None if reason is None else errors.EngineShutdown(f"the engine died: {reason}")

    def _health(self) -> tuple[bool, dict[str, Any]]:
        if self.health is None:
            return False, {"status": "starting"}
        return self.health.healthy and not self.runtime.is_shutdown(), dict(self.health.detail)
