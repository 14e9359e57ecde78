"""``VllmEngine``: vLLM v1's ``AsyncLLM`` as an ``LLMEngine``.

Lifecycle: the constructor stores settings; ``start`` imports vLLM, applies CPU-friendly defaults,
picks KV-event ports, builds the ``AsyncLLM`` (a thread, so the event loop stays live while the
engine-core process loads the model) and reports an ``EngineConfig``; ``generate`` streams
``RequestOutput`` deltas as ``LLMEngineOutput`` chunks, exactly one terminal last; ``abort``
aborts every vLLM request of a context; ``cleanup`` shuts vLLM down (idempotent).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import os
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from dynamo_zmq import errors
from dynamo_zmq.context import Context
from dynamo_zmq.llm import (
    Capability,
    EngineConfig,
    EngineLoad,
    LLMEngine,
    LLMEngineOutput,
    PreprocessedRequest,
    Usage,
    cancelled_output,
    error_output,
)
from dynamo_zmq.resources import Resources, cancel_and_wait

from ._config import (
    DISAGG_ROLES,
    KV_TOPIC,
    build_engine_args,
    engine_arg,
    relay_for,
    reported_config,
)
from ._embed import embed, pooling_capabilities
from ._lora import LoraTable
from ._options import (
    VllmOptions,
    add_vllm_args,
    engine_args_from_args,
    import_vllm,
    options_from_args,
)
from ._parent_watch import install as install_parent_watch
from ._relay import KvRelay
from ._sampling import sampling_params, to_output
from ._start import kv_ports, start_llm
from ._stats import RankStats, make_stat_logger, vllm_metrics
from ._vision import prompt_inputs

if TYPE_CHECKING:
    from dynamo_zmq.worker import WorkerConfig

__all__ = ["KV_TOPIC", "VllmEngine"]

log = logging.getLogger("engines.vllm")

#: What the engine can do when it generates (the pooling runner's are asked of vLLM).
GENERATE_CAPABILITIES = frozenset(
    {Capability.LOGPROBS, Capability.PROMPT_LOGPROBS, Capability.STRUCTURED_OUTPUTS,
     Capability.LOGIT_BIAS, Capability.DISAGGREGATION, Capability.OWN_KV_TRANSFER}
)



class VllmEngine(LLMEngine):
    """vLLM behind a dynamo-zmq worker.

    Args:
        engine_args: vLLM's ``AsyncEngineArgs``, or a dict of its fields (``model`` at least).
        options: the adapter's own settings (native processing, KV-event ports).
    """

    name = "vllm"
    supports_native_processing = True

    def __init__(self, engine_args: Any = None, options: VllmOptions | None = None) -> None:
        self.engine_args = engine_args if engine_args is not None else {}
        self.options = options or VllmOptions()
        self.engine_config: EngineConfig | None = None
        self._llm: Any = None
        #: vLLM's last scheduler stats per engine index (data-parallel rank).
        self._stats: dict[int, RankStats] = {}
        self._ids = itertools.count()
        #: Owns the abort tasks a stopped context starts.
        self._res = Resources("vllm-engine")
        self._state = "new"  # new -> starting -> started -> closed
        #: What the engine can do; a pooling runner (``--runner pooling``) only embeds.
        self._caps: frozenset[str] = GENERATE_CAPABILITIES
        #: Relays vLLM's KV events over CURVE when auth is on (``_relay.py``).
        self._relay: KvRelay | None = None
        self._loras = LoraTable()  # the LoRA adapters loaded (``_lora.py``)
        self._priority = False  # vLLM schedules by priority (``--scheduling-policy priority``)
        if self.options.lora_modules and not engine_arg(self.engine_args, "enable_lora"):
            raise errors.InvalidArgument("--lora-modules needs --enable-lora")

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        add_vllm_args(parser)

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> VllmEngine:
        return cls(engine_args_from_args(args), options_from_args(args))

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> tuple[VllmEngine, WorkerConfig]:
        """A vLLM engine and the worker's settings from command-line flags (``sys.argv[1:]``
        when None), as ``python -m dynamo_zmq.worker --engine vllm`` reads them."""
        from dynamo_zmq.worker import from_args

        return from_args(argv, engine=cls)

    @property
    def llm(self) -> Any:
        """The running ``AsyncLLM`` (None before ``start`` and after ``cleanup``)."""
        return self._llm

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self, worker_id: int) -> EngineConfig:
        """Build the ``AsyncLLM`` (loads the model in vLLM's engine-core process)."""
        if self._state != "new":
            raise RuntimeError(f"VllmEngine.start called when {self._state}")
        self._state = "starting"
        import_vllm()
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        cpu = current_platform.is_cpu()
        if cpu:
            # The uni executor keeps the model in vLLM's engine-core process (no extra worker
            # process); vLLM's CPU platform only allows it with this set. Inherited by the child.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        install_parent_watch()  # engine-core processes end with this one
        self._relay = relay = relay_for(self.engine_args, self.options, self._res,
                                        self._loras.name_of)

        def build() -> tuple[Any, tuple[int, ...]]:
            args = build_engine_args(self.engine_args, self.options, cpu, relay)
            return args, kv_ports(args) + (relay.given_ports() if relay is not None else ())

        def prepare() -> None:  # before vLLM: its PUB connects to the relay's loopback SUB
            if relay is not None and not relay.started:
                relay.start()

        def create(args: Any) -> Any:
            return AsyncLLM.from_engine_args(args, stat_loggers=[make_stat_logger(self._stats)])

        try:
            llm = await start_llm(build, create, prepare=prepare,
                                  repick=relay.repick if relay is not None else None)
        except Exception as exc:
            self._state = "new"
            if self._relay is not None:
                relay, self._relay = self._relay, None
                await relay.close()
            raise errors.EngineShutdown(f"vLLM failed to start: {exc}") from exc
        if self._state == "closed":  # cleanup ran while vLLM was loading
            await asyncio.to_thread(llm.shutdown, self.options.shutdown_timeout)
            raise RuntimeError("VllmEngine was cleaned up while starting")
        self._llm = llm
        self._state = "started"
        if llm.vllm_config.model_config.runner_type == "pooling":
            self._caps = await pooling_capabilities(llm)
        self.engine_config = config = reported_config(llm, self.options, self._relay)
        self._priority = llm.vllm_config.scheduler_config.policy == "priority"
        if Capability.EMBEDDINGS_ONLY not in self._caps:
            self._caps |= {Capability.LORA} if llm.vllm_config.lora_config is not None else set()
            self._caps |= {Capability.PRIORITY} if self._priority else set()
            self._caps |= {Capability.VISION} if config.image_token_id is not None else set()
        try:  # --lora-modules: any failure fails the start
            await self._loras.attach(llm, config.served_model_name, self.options.lora_modules)
        except errors.DynamoError:
            await self.cleanup()
            raise
        return config

    def capabilities(self) -> frozenset[str]:
        """When generating: logprobs, of the output and the prompt (vLLM's own values; the
        worker adds the token texts) and
        structured outputs (vLLM's ``StructuredOutputsParams``) and ``logit_bias``
        (``SamplingParams`` takes it), LoRA adapters with ``--enable-lora`` and priorities with
        ``--scheduling-policy priority``; under vLLM's pooling runner, embeddings (and only
        them)."""
        return self._caps

    async def load_lora(self, name: str, path: str) -> None:
        """vLLM's ``add_lora``, all or nothing (errors: ``LoraTable.load``)."""
        await self._loras.load(name, path)

    async def unload_lora(self, name: str) -> None:
        """vLLM's ``remove_lora`` (``NotFound``: no such adapter)."""
        await self._loras.unload(name)

    def lora_adapters(self) -> dict[str, str]:
        return self._loras.adapters()

    async def drain(self) -> None:
        """Nothing to hand off: in-flight requests finish in vLLM (the worker waits for them)."""

    def dead_reason(self) -> str | None:
        """Why vLLM is dead (its engine core errored or its output task ended), or None."""
        llm = self._llm
        if llm is not None and llm.errored:
            return "vLLM's engine core is dead (EngineDeadError)"
        return None

    async def clear_kv_blocks(self) -> None:
        """vLLM's ``reset_prefix_cache`` (which publishes ``AllBlocksCleared``).

        Raises:
            Unknown: vLLM refused (it does while requests hold blocks) or is not running.
        """
        if self._llm is None:
            raise errors.Unknown("the vLLM engine is not running")
        if await self._llm.reset_prefix_cache() is False:
            raise errors.Unknown("vLLM did not reset its prefix cache (requests are running?)")

    def metrics_collector(self) -> Any:
        """vLLM's own Prometheus metrics (``vllm:*``, from its stat loggers)."""
        return vllm_metrics()

    async def cleanup(self) -> None:
        """Abort what is left and shut vLLM down. Idempotent; safe before ``start``."""
        self._state = "closed"
        llm, self._llm = self._llm, None
        self._loras.detach()
        await self._res.close()
        if llm is not None:
            with contextlib.suppress(Exception):
                await llm.abort(self.live_requests.all())
            # vLLM's output task would log the engine core's exit as a failure: stop it first.
            handler = getattr(llm, "output_handler", None)
            if isinstance(handler, asyncio.Task):
                await cancel_and_wait((handler,))
            await asyncio.to_thread(llm.shutdown, self.options.shutdown_timeout)
        self.live_requests.clear()

    def load(self) -> list[EngineLoad]:
        """Per data-parallel rank, from vLLM's last scheduler stats: the KV-cache usage as
        blocks of the rank's cache, running and waiting requests. Ranks vLLM has not reported
        yet are left out (empty before the first engine step)."""
        cfg = self.engine_config
        if self._llm is None or cfg is None or not cfg.total_kv_blocks:
            return []
        total = cfg.total_kv_blocks
        out = []
        for index, st in sorted(self._stats.items()):
            rank = index - cfg.data_parallel_start_rank
            if 0 <= rank < cfg.data_parallel_size:
                active = min(total, max(0, round(st.kv_usage * total)))
                out.append(EngineLoad(rank, active, total, st.num_running, st.num_waiting))
        return out

    def stats(self) -> dict[str, float]:
        """KV-cache use and queue lengths summed over the ranks (see ``load``)."""
        ranks = self.load()
        if not ranks:
            return {}
        active = sum(r.active_blocks for r in ranks)
        total = sum(r.total_blocks for r in ranks)
        return {
            "kv_usage": active / total,
            "kv_active_blocks": float(active),
            "kv_total_blocks": float(total),
            "num_running": float(sum(r.num_running for r in ranks)),
            "num_waiting": float(sum(r.num_waiting for r in ranks)),
        }

    # -- requests --------------------------------------------------------------------------

    def _check(self, request: PreprocessedRequest) -> str | None:
        """Why ``request`` cannot run (as an error chunk), or None."""
        if self._state != "started" or self._llm is None:
            return "the vLLM engine is not running"
        if not request.token_ids:
            return "the prompt is empty"
        rank = request.routing.dp_rank
        size = self.engine_config.data_parallel_size if self.engine_config else 1
        if rank is not None and not 0 <= rank < size:
            return f"dp_rank {rank} out of range: this engine serves ranks 0..{size - 1}"
        return None

    async def generate(
        self, request: PreprocessedRequest, ctx: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        """Stream vLLM's deltas for ``request``; exactly one terminal chunk, last.

        Raises:
            InvalidArgument: vLLM rejected the request (sampling options, prompt too long), or
                the engine runs an embedding model (``--runner pooling``), which cannot generate.
        """
        if Capability.EMBEDDINGS_ONLY in self._caps:
            raise errors.InvalidArgument(
                "this vLLM engine runs the model as an embedding model (--runner pooling): it "
                "cannot generate; use /v1/embeddings"
            )
        prompt_tokens = len(request.token_ids)
        problem = self._check(request)
        if problem is not None:
            yield error_output(problem, Usage(prompt_tokens))
            return
        lora = None if request.lora_name is None else self._loras.request(request.lora_name)
        prompt = prompt_inputs(request.token_ids, request.media, self.engine_config)
        if ctx.is_stopped():
            yield cancelled_output(Usage(prompt_tokens, 0))
            return
        from vllm.exceptions import VLLMValidationError
        from vllm.v1.engine.exceptions import EngineDeadError

        detokenize = self.options.native_processing or request.output.detokenize
        params = sampling_params(request, self.options.native_processing,
                                 self.options.disaggregation_mode in DISAGG_ROLES)
        llm = self._llm
        size = self.engine_config.data_parallel_size if self.engine_config else 1
        rank = request.routing.dp_rank if size > 1 else None
        rid, key = f"{ctx.id()}-{next(self._ids)}", ctx.id()
        self.live_requests.add(key, rid)
        stream = llm.generate(  # priority under fcfs: 0 (vLLM: others are errors)
            prompt, params, rid, data_parallel_rank=rank, lora_request=lora,
            priority=request.priority if self._priority else 0,
        )
        remove = ctx.add_listener(lambda _killed: self._spawn_abort(llm, [rid]))
        completion = 0
        terminal = False
        num_logprobs = request.output.logprobs
        try:
            while True:
                try:
                    out = await stream.__anext__()
                except StopAsyncIteration:
                    break
                except (VLLMValidationError, ValueError, TypeError) as exc:
                    raise errors.InvalidArgument(f"vLLM rejected the request: {exc}") from exc
                except EngineDeadError as exc:  # the engine core process is gone
                    raise errors.EngineShutdown(f"vLLM's engine core died: {exc}") from exc
                chunk, completion = to_output(
                    out, prompt_tokens, completion, detokenize, num_logprobs
                )
                if chunk is None:
                    continue
                if ctx.is_stopped() and not chunk.is_terminal:
                    # Stopped before vLLM knew the request (abort found nothing) or while the
                    # abort is on its way: end now; closing the stream aborts it in vLLM.
                    if chunk.token_ids or chunk.text:
                        yield chunk
                    terminal = True
                    yield cancelled_output(Usage(prompt_tokens, completion))
                    return
                if chunk.is_terminal:
                    terminal = True
                yield chunk
                if terminal:
                    return
            if not terminal:
                terminal = True
                usage = Usage(prompt_tokens, completion)
                if ctx.is_stopped():
                    yield cancelled_output(usage)
                else:
                    yield error_output("vLLM's stream ended without a finish reason", usage)
        finally:
            remove()
            self.live_requests.remove(key, rid)
            # Closing vLLM's generator early aborts the request inside vLLM.
            with contextlib.suppress(Exception):
                await stream.aclose()

    async def embed(self, request: PreprocessedRequest, ctx: Context) -> list[float]:
        """The embedding of ``request.token_ids`` (``--runner pooling``: ``AsyncLLM.encode``)."""
        if Capability.EMBEDDINGS not in self._caps or self._llm is None:
            raise errors.Unsupported("this vLLM engine does not embed (start it with --runner "
                                     "pooling --convert embed)")
        rid, key = f"{ctx.id()}-{next(self._ids)}", ctx.id()
        self.live_requests.add(key, rid)
        try:
            return await embed(self._llm, request, ctx, rid)
        finally:
            self.live_requests.remove(key, rid)

    async def abort(self, ctx: Context) -> None:
        """Abort every vLLM request of ``ctx`` now (its streams end with ``cancelled``)."""
        rids = self.live_requests.of(ctx.id())
        if rids and self._llm is not None:
            await self._llm.abort(rids)

    def _spawn_abort(self, llm: Any, rids: list[str]) -> None:
        if not self._res.closed:  # once closed, cleanup aborts whatever is left
            self._res.spawn(llm.abort(rids), f"vllm-abort-{rids[0]}")
