"""``MockerEngine``: a CPU-only stand-in for vLLM that schedules, caches and publishes KV events
like the real engine, but samples random tokens and sleeps for the simulated step time."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from dynamo_zmq import errors
from dynamo_zmq.context import Context
from dynamo_zmq.kv_transfer import Ticket
from dynamo_zmq.llm import (
    Capability,
    DecodeRemotely,
    EngineConfig,
    EngineLoad,
    FinishReason,
    KvHashScheme,
    LLMEngine,
    LLMEngineOutput,
    PrefillRemotely,
    PreprocessedRequest,
    Usage,
    cancelled_output,
    error_output,
)

from ._config import MockerConfig, add_mocker_args, config_from_args
from ._disagg import DisaggStats, offer_prompt_kv, pull_prompt_kv
from ._embed import mock_embedding
from ._kv_events import KvEvent
from ._lora import Adapters, ResidentAdapters
from ._metrics import MockerCollector
from ._publisher import TOPIC, KvEventPublisher
from ._request import media_problem, new_sequence, request_problem
from ._scheduler import RankScheduler
from ._sequence import SeqStatus
from ._timing import step_seconds

if TYPE_CHECKING:
    from dynamo_zmq.worker import WorkerConfig

__all__ = ["MockerEngine"]

log = logging.getLogger("engines.mocker")


class MockerEngine(LLMEngine):
    """Simulated vLLM: continuous batching, chunked prefill, preemption, prefix caching and
    vLLM-format KV events, per data-parallel rank, with Dynamo's mocker timing model.

    Args:
        config: the settings; ``from_args`` builds them from the worker's flags.
    """

    name = "mocker"

    def __init__(self, config: MockerConfig | None = None) -> None:
        self.config = config or MockerConfig()
        self.engine_config: EngineConfig | None = None
        self._ranks: list[RankScheduler] = []
        self._publisher: KvEventPublisher | None = None
        self._state = "new"  # new -> started -> closed
        self._disagg = DisaggStats()
        self._collector = MockerCollector(
            lambda: sum(r.num_prefill_tokens for r in self._ranks), self._disagg,
            lambda: (sum(r.loads for r in self.resident), sum(r.evictions for r in self.resident)),
        )
        self.adapters = Adapters(self.config.max_lora_rank)
        #: Per rank: the LoRA adapters resident there (``--max-loras``).
        self.resident: list[ResidentAdapters] = []

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        add_mocker_args(parser)

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> MockerEngine:
        return cls(config_from_args(args))

    @classmethod
    def from_args(cls, argv: Seq[str] | None = None) -> tuple[MockerEngine, WorkerConfig]:
        """A mocker and the worker's settings from command-line flags (``sys.argv[1:]`` when
        None), as ``python -m dynamo_zmq.worker --engine mocker`` reads them."""
        from dynamo_zmq.worker import from_args

        return from_args(argv, engine=cls)

    @property
    def ranks(self) -> tuple[RankScheduler, ...]:
        """The per-rank schedulers (their queues and block managers), for inspection."""
        return tuple(self._ranks)

    @property
    def publisher(self) -> KvEventPublisher | None:
        return self._publisher

    async def start(self, worker_id: int) -> EngineConfig:
        """Bind the KV-event sockets and start one scheduler per data-parallel rank."""
        if self._state != "new":
            raise RuntimeError(f"MockerEngine.start called when {self._state}")
        self._state = "started"
        cfg = self.config
        try:
            if cfg.enable_kv_events:
                self._publisher = KvEventPublisher(
                    cfg.bind_host, cfg.kv_events_port, cfg.kv_replay_port, cfg.replay_buffer_size,
                    form=cfg.kv_event_form,
                )
                await self._publisher.start()
            for rank in range(cfg.data_parallel_size):
                sched = RankScheduler(rank, cfg, self._publish if self._publisher else None)
                sched.start()
                self._ranks.append(sched)
                self.resident.append(ResidentAdapters(
                    cfg.max_loras, cfg.lora_load_delay / cfg.speedup_ratio))
            for name, path in cfg.lora_modules:
                self.adapters.load(name, path)
        except BaseException:
            await self.cleanup()
            raise
        events = replay = None
        if self._publisher is not None:
            host = cfg.advertised_host()
            events = f"tcp://{host}:{self._publisher.events_port}"
            replay = f"tcp://{host}:{self._publisher.replay_port}"
        self.engine_config = EngineConfig(
            model_name=cfg.model_name,
            served_model_name=cfg.model_name,
            context_length=cfg.context_length,
            kv_block_size=cfg.block_size,
            total_kv_blocks=cfg.num_gpu_blocks,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            data_parallel_size=cfg.data_parallel_size,
            data_parallel_start_rank=0,
            kv_events_endpoint=events,
            kv_replay_endpoint=replay,
            kv_hash_scheme=self._hash_scheme() if self._publisher else None,
            image_token_id=cfg.image_token if cfg.tokens_per_image else None,
            tokens_per_image=cfg.tokens_per_image,
            extra={"engine": "mocker", "speedup_ratio": cfg.speedup_ratio,
                   "enable_prefix_caching": cfg.enable_prefix_caching,
                   "kv_events_topic": TOPIC.decode(), "kv_events_format": "vllm",
                   # The adapters resident per rank (the KV router's residency prediction).
                   **({"max_loras": cfg.max_loras} if cfg.enable_lora else {})},
        )
        return self.engine_config

    def _hash_scheme(self) -> KvHashScheme:
        """The router's scheme, under the configured root seed if one is (``--kv-hash-seed``)."""
        scheme = KvHashScheme.ours(self.config.block_size, self.config.kv_event_form)
        if self.config.kv_hash_seed is not None:
            scheme.seed = self.config.kv_hash_seed
        return scheme

    def _publish(self, events: list[KvEvent], dp_rank: int) -> None:
        if self._publisher is not None:
            self._publisher.publish(events, dp_rank)

    def generate(
        self, request: PreprocessedRequest, ctx: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        """Stream one token per step, ending with exactly one terminal chunk (a request with a
        LoRA adapter first makes it resident on its rank: ``_lora.py``)."""
        if request.lora_name is None:
            return self._run(request, ctx)
        return self._run_lora(request, ctx, request.lora_name)

    async def _run_lora(
        self, request: PreprocessedRequest, ctx: Context, lora: str
    ) -> AsyncIterator[LLMEngineOutput]:
        if (problem := self._check(request)) is not None:
            yield error_output(problem, Usage(prompt_tokens=len(request.token_ids)))
            return
        if lora not in self.adapters.loaded:
            raise errors.NotFound(f"the mocker holds no LoRA adapter {lora!r}")
        sched = self._pick_rank(request.routing.dp_rank)
        async for chunk in self.resident[sched.rank].serve(
                lora, ctx, len(request.token_ids), self._run(request, ctx, sched)):
            yield chunk

    async def _run(
        self, request: PreprocessedRequest, ctx: Context, sched: RankScheduler | None = None
    ) -> AsyncGenerator[LLMEngineOutput, None]:
        """One request on rank ``sched`` (None: the one its routing or the load picks)."""
        prompt_usage = Usage(prompt_tokens=len(request.token_ids))
        problem = self._check(request)
        if problem is not None:
            yield error_output(problem, prompt_usage)
            return
        if request.media is not None and (bad := media_problem(self.config, request)):
            raise errors.InvalidArgument(bad)
        if ctx.is_stopped():
            yield cancelled_output(Usage(len(request.token_ids), 0, 0))
            return
        if sched is None:
            sched = self._pick_rank(request.routing.dp_rank)
        seq = new_sequence(self.config, request)
        role, kv = request.disaggregation, self.kv_transfer
        if role is not None and kv is not None:
            if (isinstance(role, PrefillRemotely) and isinstance(role.handoff, Ticket)
                    and kv.client):
                try:
                    await pull_prompt_kv(kv.client, role.handoff, seq, self.config, ctx,
                                         self._disagg)
                except errors.Cancelled:
                    yield cancelled_output(Usage(len(request.token_ids), 0, 0))
                    return
            elif isinstance(role, DecodeRemotely) and kv.server is not None:
                seq.hold_on_finish = True
        key = ctx.id()
        entry = (sched, seq)
        self.live_requests.add(key, entry)
        sched.add(seq, request.priority)
        remove_listener = ctx.add_listener(lambda _killed: sched.cancel(seq))
        create_future = asyncio.get_running_loop().create_future
        outbox = seq.outbox
        try:
            while True:
                while not outbox:  # inline, not a helper coroutine: one frame less per token
                    # ``emit`` completes it (a done one left behind is never completed again)
                    seq.waiter = waiter = create_future()
                    await waiter
                chunk = outbox.popleft()
                if chunk.finish_reason is not None:
                    if chunk.finish_reason == FinishReason.ERROR and sched.crashed is not None:
                        raise errors.EngineShutdown(sched.crashed)
                    if seq.hold_on_finish and kv is not None and kv.server is not None:
                        chunk.kv_handoff = offer_prompt_kv(
                            kv.server, sched, seq, self.config, self._disagg
                        )
                        seq.hold_on_finish = False  # offered (or released): not ours to free
                    yield chunk
                    return
                yield chunk
        finally:
            remove_listener()
            self.live_requests.remove(key, entry)
            if seq.status is not SeqStatus.FINISHED:
                sched.cancel(seq, emit=False)
            elif seq.hold_on_finish:  # finished, but its terminal was never read: no handoff
                sched.release_held(seq)

    def _check(self, request: PreprocessedRequest) -> str | None:
        """Why ``request`` cannot run, or None (``_request.py``)."""
        if self._state != "started":
            return "the mocker engine is not running"
        return request_problem(self.config, request, len(self._ranks))

    def _pick_rank(self, rank: int | None) -> RankScheduler:
        if rank is not None:
            return self._ranks[rank]
        return min(self._ranks, key=lambda r: (r.load, r.blocks.num_active, r.rank))

    def capabilities(self) -> frozenset[str]:
        """Logprobs (well-formed made-up values: see ``Sequence.with_logprobs``),
        ``logit_bias`` (its sampling weighs each token by ``exp(bias)`` against 1),
        disaggregation (``_disagg``), embeddings when ``--mock-embedding-dim`` is set,
        priority scheduling under ``--scheduling-policy priority``, images (vision) with
        ``--tokens-per-image``."""
        caps = {Capability.LOGPROBS, Capability.LOGIT_BIAS, Capability.DISAGGREGATION}
        if self.config.embedding_dim:
            caps.add(Capability.EMBEDDINGS)
        if self.config.scheduling_policy == "priority":
            caps.add(Capability.PRIORITY)
        if self.config.enable_lora:
            caps.add(Capability.LORA)
        if self.config.tokens_per_image:
            caps.add(Capability.VISION)
        return frozenset(caps)

    async def load_lora(self, name: str, path: str) -> None:
        """Register the peft adapter at ``path`` (``Adapters.load``; ``Unsupported`` without
        ``--enable-lora``); it becomes resident on a rank when a request needs it there."""
        self._lora_enabled()
        self.adapters.load(name, path)

    async def unload_lora(self, name: str) -> None:
        """Forget adapter ``name`` (``Adapters.unload``); requests running with it finish."""
        self._lora_enabled()
        self.adapters.unload(name)

    def _lora_enabled(self) -> None:
        if not self.config.enable_lora:
            raise errors.Unsupported("the mocker serves LoRA adapters only with --enable-lora")

    def lora_adapters(self) -> dict[str, str]:
        return dict(self.adapters.loaded)

    async def embed(self, request: PreprocessedRequest, ctx: Context) -> list[float]:
        """A deterministic unit vector of ``--mock-embedding-dim`` floats per token sequence,
        after the simulated prefill time of its tokens (not scheduled, no KV blocks).

        Raises:
            Unsupported: the mocker was started without ``--mock-embedding-dim``.
            InvalidArgument: ``dimensions`` asked (the mocker is no matryoshka model).
            Cancelled: ``ctx`` was stopped first.
        """
        cfg = self.config
        if not cfg.embedding_dim:
            raise errors.Unsupported("the mocker embeds only with --mock-embedding-dim")
        if request.embedding is not None and request.embedding.dimensions is not None:
            raise errors.InvalidArgument("the mocker cannot change the embedding's dimensions")
        delay = step_seconds(
            len(request.token_ids), 0, 0.0, cfg.speedup_ratio, cfg.prefill_ms_per_token
        )
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await ctx.stopped()
        if ctx.is_stopped():
            raise errors.Cancelled("the embedding request was stopped")
        return mock_embedding(request.token_ids, cfg.embedding_dim)

    async def abort(self, ctx: Context) -> None:
        """Cancel every sequence of ``ctx`` now (its stream ends with ``cancelled``)."""
        for sched, seq in self.live_requests.of(ctx.id()):
            sched.cancel(seq)

    async def drain(self) -> None:
        """Wait until every rank is idle (the in-flight requests finish here)."""
        await asyncio.gather(*(r.drain() for r in self._ranks))

    def dead_reason(self) -> str | None:
        """Why the engine is dead: the first rank whose scheduler task crashed (None: alive)."""
        return next((r.crashed for r in self._ranks if r.crashed is not None), None)

    def load(self) -> list[EngineLoad]:
        """Per rank: blocks held by running sequences, the rank's blocks, running and waiting
        sequences (empty before ``start`` and after ``cleanup``)."""
        return [
            EngineLoad(
                r.rank, r.blocks.num_active, r.blocks.num_blocks, len(r.running), len(r.waiting)
            )
            for r in self._ranks
        ]

    def metrics_collector(self) -> MockerCollector:
        """The ``mocker_*`` counters (prefill tokens computed, KV handoffs and pulls)."""
        return self._collector

    def stats(self) -> dict[str, float]:
        """KV blocks in use and sequences held, summed over the ranks (for worker metrics)."""
        ranks = self._ranks
        return {
            "kv_active_blocks": float(sum(r.blocks.num_active for r in ranks)),
            "kv_total_blocks": float(sum(r.blocks.num_blocks for r in ranks)),
            "num_running": float(sum(len(r.running) for r in ranks)),
            "num_waiting": float(sum(len(r.waiting) for r in ranks)),
        }

    def reset_prefix_cache(self) -> bool:
        """Drop every rank's cached blocks (``AllBlocksCleared``); False if any rank is busy."""
        return all([r.reset_prefix_cache() for r in self._ranks])

    async def clear_kv_blocks(self) -> None:
        """Drop every rank's cached blocks that no running sequence holds, publishing the
        ``BlockRemoved`` / ``AllBlocksCleared`` events that make routers forget them."""
        dropped = sum(r.clear_kv_blocks() for r in self._ranks)
        log.info("cleared %d cached KV blocks", dropped)

    async def cleanup(self) -> None:
        """Stop the schedulers (unfinished streams end with an error) and close the sockets.
        Idempotent and safe before ``start``."""
        self._state = "closed"
        for slots in self.resident:
            slots.close()
        ranks, self._ranks = self._ranks, []
        for sched in ranks:
            await sched.close()
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            await publisher.close()

