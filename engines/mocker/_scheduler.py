"""The continuous-batching scheduler of one data-parallel rank (vLLM v1's policy, simulated).

Each step shares a budget of ``max_num_batched_tokens`` between:

1. the **running** sequences, oldest first: one token each when decoding, the rest of their
   prompt (up to the budget left) when prefilling, so a long prompt is prefilled in chunks.
   When the KV cache cannot hold a sequence's next tokens, the newest running sequence is
   preempted (blocks freed, recomputed later from its prompt and outputs) until it fits;
2. then, if nothing was preempted, **waiting** sequences in arrival order while there are fewer
   than ``max_num_seqs`` running and the cache can hold their first chunk. A new sequence
   starts from its longest cached prefix (those blocks need no prefill).

The step then "runs" for the time the model says, after which each sequence whose known tokens
are all computed samples one token. Newly full blocks enter the prefix cache, and the step's KV
events go out as one batch. One task per rank runs steps while there is work and sleeps on an
event otherwise.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq

from dynamo_zmq.llm import FinishReason, LLMEngineOutput
from dynamo_zmq.resources import Resources

from ._blocks import BlockManager
from ._config import MockerConfig
from ._kv_events import KvEvent
from ._sequence import SeqStatus, Sequence
from ._timing import step_seconds

__all__ = ["Publish", "RankScheduler", "StepPlan"]

log = logging.getLogger(__name__)

Publish = Callable[[list[KvEvent], int], object]
"""Sends one batch of KV events for a rank: ``publish(events, dp_rank)``."""


class StepPlan:
    """What one step computes: ``(sequence, new tokens)`` pairs and the cost model's inputs."""

    __slots__ = ("decoding", "prefill_tokens", "scheduled")

    def __init__(self) -> None:
        self.scheduled: list[tuple[Sequence, int]] = []
        self.prefill_tokens = 0
        self.decoding = 0

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.scheduled.append((seq, num_tokens))
        if seq.in_prefill:
            self.prefill_tokens += num_tokens
        else:
            self.decoding += 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class RankScheduler:
    """Waiting and running queues, the block manager and the step loop of one rank."""

    def __init__(self, rank: int, config: MockerConfig, publish: Publish | None = None) -> None:
        self.rank = rank
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.speedup_ratio = config.speedup_ratio
        self.prefill_ms_per_token = config.prefill_ms_per_token
        self.blocks = BlockManager(
            config.num_gpu_blocks, config.block_size, config.enable_prefix_caching
        )
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_steps = 0
        self.num_preemptions = 0
        #: Prompt tokens computed by prefill steps (a pulled prompt adds none).
        self.num_prefill_tokens = 0
        self._publish = publish
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._res = Resources(f"mocker-rank-{rank}")
        self._started = False
        self._failure: str | None = None
        #: Why the step loop died (None while it runs or after a clean close).
        self.crashed: str | None = None

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the step loop (on the running event loop)."""
        if not self._started and not self._res.closed:
            self._started = True
            self._res.spawn(self._run(), f"mocker-rank-{self.rank}")

    async def close(self) -> None:
        """Stop the step loop; every unfinished sequence ends with an error."""
        await self._res.close()
        self._failure = self._failure or "the mocker engine shut down"
        self._fail_all(self._failure)

    async def drain(self) -> None:
        """Wait until no sequence is waiting or running."""
        await self._idle.wait()

    @property
    def load(self) -> int:
        """Sequences this rank holds (waiting and running)."""
        return len(self.waiting) + len(self.running)

    # -- requests ---------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence."""
        if self._failure is not None:
            self._finish(seq, FinishReason.ERROR, error=self._failure)
            return
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)
        self._idle.clear()
        self._wake.set()

    def cancel(self, seq: Sequence, emit: bool = True) -> None:
        """Take ``seq`` out of the batch now and free its blocks; its stream gets a
        ``cancelled`` terminal unless ``emit`` is False. No-op once finished."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        self._finish(seq, FinishReason.CANCELLED, emit=emit)
        if not self.waiting and not self.running:
            self._idle.set()

    def release_held(self, seq: Sequence) -> None:
        """Free the blocks a finished ``hold_on_finish`` sequence kept for its KV transfer:
        they stay cached for prefix reuse, like any finished sequence's. Idempotent."""
        if seq.status is SeqStatus.FINISHED and seq.block_ids:
            self.blocks.free(seq.block_ids)
            seq.block_ids = []
            self._wake.set()  # a waiting sequence may fit now

    def reset_prefix_cache(self) -> bool:
        """Drop all cached blocks (published at once); False while sequences hold blocks."""
        ok = self.blocks.reset_prefix_cache()
        self._flush_events()
        return ok

    def clear_kv_blocks(self) -> int:
        """Drop every cached block no sequence holds (published at once); returns how many."""
        dropped = self.blocks.clear_cached()
        self._flush_events()
        return dropped

    # -- the step loop ----------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not self.waiting and not self.running:
                    self._idle.set()
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                started = loop.time()
                plan = self.schedule()
                if not plan.scheduled:
                    # Nothing can run until something changes; never spin.
                    self._flush_events()
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                delay = step_seconds(
                    plan.prefill_tokens, plan.decoding, self.blocks.usage, self.speedup_ratio,
                    self.prefill_ms_per_token,
                )
                # Always yield to the loop, and count the scheduling work as part of the step.
                await asyncio.sleep(max(0.0, started + delay - loop.time()))
                self.apply(plan)
                self._flush_events()
        except Exception as exc:
            log.exception("mocker rank %d failed", self.rank)
            self._failure = self.crashed = f"mocker rank {self.rank} crashed: {exc!r}"
            self._fail_all(self._failure)

    def schedule(self) -> StepPlan:
        """Choose this step's work and allocate its KV blocks (see the module docstring)."""
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        size = self.block_size
        preempted = False
        # The running sequences, once per step each: ``plan.add`` and ``_grow`` inlined, the
        # latter called only when a sequence needs another block (once per ``size`` tokens).
        running = self.running  # ``_grow`` pops preempted sequences from this same list
        scheduled = plan.scheduled
        prefill_tokens = decoding = 0
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            computed = seq.num_computed
            n = len(seq.tokens) - computed
            if n > budget:
                n = budget
            need = -(-(computed + n) // size) - len(seq.block_ids)
            if need > 0 and not self._grow(seq, need):
                preempted = True
                if seq.status is not SeqStatus.RUNNING:
                    break  # it was the newest itself, or alone and too large
            scheduled.append((seq, n))
            if seq.in_prefill:
                prefill_tokens += n
            else:
                decoding += 1
            budget -= n
            i += 1
        plan.prefill_tokens = prefill_tokens
        plan.decoding = decoding
        if preempted:
            return plan
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits: list[int] = []
            if self.blocks.enable_caching:
                # The last prompt token is always computed (its logits give the next token).
                hits = self.blocks.match_prefix(seq.block_hashes((seq.num_tokens - 1) // size))
            computed = len(hits) * size
            # A pulled prompt (decode role): its KV is all here; the step only samples.
            remote = seq.remote_kv
            if remote:
                computed = seq.num_tokens
            n = min(seq.num_tokens - computed, budget)
            blocks = self.blocks.allocate(_cdiv(computed + n, size) - len(hits), hits)
            if blocks is None:
                if not self.running:  # everything is free and it still does not fit
                    self.waiting.popleft()
                    self._finish(seq, FinishReason.LENGTH)
                    continue
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            seq.block_ids = blocks
            seq.num_computed = computed
            seq.num_hashed_blocks = len(hits)
            seq.in_prefill = not remote
            seq.remote_kv = False  # preempted later, it is recomputed here
            if seq.cached_tokens is None:
                seq.cached_tokens = len(hits) * size if remote else computed
            self.running.append(seq)
            plan.add(seq, n)
            budget -= n
        return plan

    def _grow(self, seq: Sequence, need: int) -> bool:
        """Give ``seq`` ``need`` more blocks, preempting the newest running sequences as needed.
        Returns False if anything was preempted or finished (``seq`` itself perhaps)."""
        if need <= 0:
            return True
        touched = False
        while (new := self.blocks.allocate(need)) is None:
            touched = True
            victim = self.running.pop()
            if victim is seq and not self.running:
                # Alone and still too large: the KV cache is its context limit.
                self._finish(seq, FinishReason.LENGTH)
                return False
            self._preempt(victim)
            if victim is seq:
                return False
        seq.block_ids.extend(new)
        return not touched

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq.block_ids)
        seq.block_ids = []
        seq.num_computed = 0
        seq.num_hashed_blocks = 0
        seq.in_prefill = True
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def apply(self, plan: StepPlan) -> None:
        """Account the computed tokens, cache newly full blocks and sample one token for every
        sequence whose known tokens are all computed."""
        self.num_steps += 1
        self.num_prefill_tokens += plan.prefill_tokens
        finished = False
        running_status = SeqStatus.RUNNING
        caching = self.blocks.enable_caching
        size = self.block_size
        # Once per scheduled sequence and step: ``_cache_full_blocks`` is called only when a
        # block filled up, and ``Sequence.emit`` is inlined for the common chunk.
        for seq, n in plan.scheduled:
            if seq.status is not running_status:
                continue  # cancelled while the step ran
            computed = seq.num_computed = seq.num_computed + n
            if caching and computed // size > seq.num_hashed_blocks:
                self._cache_full_blocks(seq)
            if computed < len(seq.tokens):
                continue  # a prefill chunk
            seq.in_prefill = False
            token = seq.sample()
            reason = seq.append(token)
            if reason is not None:
                self._finish(seq, reason, [token])
                finished = True
            elif seq.num_logprobs is not None:
                seq.emit(seq.with_logprobs(LLMEngineOutput([token])))
            else:
                seq.outbox.append(LLMEngineOutput([token]))
                waiter = seq.waiter
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)
        if finished:
            self.running = [s for s in self.running if s.status is SeqStatus.RUNNING]

    def _cache_full_blocks(self, seq: Sequence) -> None:
        if not self.blocks.enable_caching:
            return
        size = self.block_size
        full = seq.num_computed // size
        start = seq.num_hashed_blocks
        if full <= start:
            return
        hashes = seq.block_hashes(full)
        self.blocks.cache_blocks(
            seq.block_ids[start:full], hashes[start:], hashes[start - 1] if start else None,
            seq.tokens[start * size : full * size], seq.own_hashes(full)[start:], seq.lora_name,
        )
        seq.num_hashed_blocks = full

    def _finish(self, seq: Sequence, reason: str, token_ids: Seq[int] = (),
                error: str | None = None, emit: bool = True) -> None:
        """End ``seq`` (already out of the queues): free its blocks (unless it keeps them for a
        KV transfer: a normal end of a ``hold_on_finish`` one), queue its terminal chunk."""
        keep = (seq.hold_on_finish and reason in (FinishReason.STOP, FinishReason.LENGTH)
                and seq.num_computed >= seq.num_prompt)  # a whole prompt's KV, nothing less
        if seq.block_ids and not keep:
            self.blocks.free(seq.block_ids)
            seq.block_ids = []
        seq.status = SeqStatus.FINISHED
        if emit:
            seq.emit(seq.with_logprobs(LLMEngineOutput(
                list(token_ids), finish_reason=reason, usage=seq.usage(), error=error
            )))

    def _fail_all(self, message: str) -> None:
        doomed = [*self.running, *self.waiting]
        self.running.clear()
        self.waiting.clear()
        for seq in doomed:
            self._finish(seq, FinishReason.ERROR, error=message)
        self._idle.set()

    def _flush_events(self) -> None:
        events = self.blocks.take_events()
        if events and self._publish is not None:
            self._publish(events, self.rank)
