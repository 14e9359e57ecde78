"""One request inside the mocker: its tokens, KV blocks, token generator, stop rules and the
queue of chunks its stream has not read yet."""

from __future__ import annotations

import array
import asyncio
import bisect
import collections
import enum
import functools
import itertools
import math
import random
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq

import xxhash

from dynamo_zmq.llm import FinishReason, LLMEngineOutput, MediaItem, Usage
from dynamo_zmq.llm._block_hashing import ROOT_SEED, extra_key_hash, salted_block_hashes
from dynamo_zmq.llm._block_hashing import block_hashes as router_hashes
from dynamo_zmq.llm._media_keys import block_extra_keys

from ._hashing import block_hash, lora_roots

__all__ = ["SeqStatus", "Sequence", "sequence_seed"]


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def sequence_seed(seed: int, prompt: Seq[int]) -> int:
    """The generator seed of a request: its seed mixed with a hash of its prompt."""
    digest = xxhash.xxh64_intdigest(array.array("I", prompt).tobytes())
    return ((seed & 0xFFFF_FFFF_FFFF_FFFF) << 64) | digest


class Sequence:
    """A request's state; the scheduler moves it between its queues and the stream reads it."""

    def __init__(self, prompt: Seq[int], *, block_size: int, vocab_size: int, seed: int,
                 max_tokens: int, min_tokens: int = 0, stop_token_ids: Iterable[int] = (),
                 eos_token_ids: Iterable[int] = (), ignore_eos: bool = False,
                 request_id: str = "", resumed: int = 0,
                 num_logprobs: int | None = None,
                 logit_bias: dict[int, float] | None = None,
                 hash_root: int | None = None, lora_name: str | None = None,
                 media: Seq[MediaItem] | None = None) -> None:
        self.request_id = request_id
        #: Per prompt block, the ``mm_hash`` of the images it holds (None: no image there, or
        #: no images at all): they salt its hashes, in the prefix cache and the router's alike.
        self._extra = (block_extra_keys(media, len(prompt) // block_size, block_size)
                       if media else None)
        #: The LoRA adapter it runs with (None: the base model); its blocks chain from the
        #: adapter's roots (``lora_roots``), so they are cached and published apart.
        self.lora_name = lora_name
        self._cache_root, hash_root = lora_roots(lora_name, hash_root)
        self.tokens: list[int] = list(prompt)
        self.num_prompt = len(self.tokens)
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.stop_token_ids = frozenset(stop_token_ids)
        self.eos_token_ids = frozenset(() if ignore_eos else eos_token_ids)
        # A migrated request (its last ``resumed`` prompt tokens are output another worker
        # sampled) continues the generator of the original prompt where that worker left it.
        original = self.tokens[: len(self.tokens) - resumed] if resumed > 0 else self.tokens
        self._rng = random.Random(sequence_seed(seed, original))
        if logit_bias:  # only then: unbiased sampling stays one randrange per token
            self.sample = _Biased(self._rng, vocab_size, logit_bias).sample  # type: ignore[method-assign]
        else:
            # ``randrange(n)`` is ``_randbelow(n)`` after checking its argument: the same draws,
            # one Python call per token instead of three (``randrange`` where there is none).
            draw: Callable[[int], int] = getattr(self._rng, "_randbelow", self._rng.randrange)
            self.sample = functools.partial(draw, vocab_size)  # type: ignore[method-assign]
        for _ in range(max(0, resumed)):
            self.sample()
        self._hashes: list[int] = []
        self._own: list[int] = []
        self._hash_root = hash_root  # the parent of the first own hash (None: ROOT_SEED)
        #: Top alternatives per token when the request asks for logprobs (None: it does not);
        #: their values come from a generator of their own, so the tokens do not change.
        self.num_logprobs = None if num_logprobs is None else min(num_logprobs, vocab_size - 1)
        self._lp_rng: random.Random | None = None  # made only for a request that asks
        if self.num_logprobs is not None:
            self._lp_rng = random.Random(sequence_seed(seed ^ 0x10C9, original))
            for _ in range(max(0, resumed)):  # a migrated request's values go on unchanged
                self._position(-1, self.num_logprobs)
        self.status = SeqStatus.WAITING
        #: KV blocks held (prefix hits first), tokens whose KV is computed, blocks already hashed.
        self.block_ids: list[int] = []
        self.num_computed = 0
        self.num_hashed_blocks = 0
        #: True until the first token after an admission is sampled (prefill or recompute).
        self.in_prefill = True
        #: Prompt tokens served from the prefix cache at the first admission.
        self.cached_tokens: int | None = None
        self.num_preemptions = 0
        #: Prefill role: keep the blocks when finished, for a KV transfer (``release_held``).
        self.hold_on_finish = False
        #: Scheduling priority (lower first) and arrival number: the waiting queue's order
        #: under ``--scheduling-policy priority`` (``_waiting.py``).
        self.priority = 0
        self.arrival = 0
        #: Decode role: the prompt's KV was pulled; the next admission computes none of it.
        self.remote_kv = False
        self.outbox: collections.deque[LLMEngineOutput] = collections.deque()
        #: The stream's consumer waiting for ``outbox`` (a bare future: an Event costs more per
        #: token, and there is one waiter); left behind done once it was woken.
        self.waiter: asyncio.Future[None] | None = None

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed}, blocks={len(self.block_ids)})")

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    def block_hashes(self, num_blocks: int) -> list[int]:
        """Chained hashes of the first ``num_blocks`` full blocks (computed once, kept)."""
        size = self.block_size
        hashes = self._hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            h = block_hash(hashes[-1] if hashes else self._cache_root,
                           self.tokens[i * size : (i + 1) * size])
            extra = self._extra_key(i)
            hashes.append(h if extra is None else extra_key_hash(h, extra))
        return hashes[:num_blocks]

    def _extra_key(self, block: int) -> list[str] | None:
        extra = self._extra
        return extra[block] if extra is not None and block < len(extra) else None

    def own_hashes(self, num_blocks: int) -> list[int]:
        """The router's hashes (``KvHashScheme``) of the first ``num_blocks`` full blocks, which
        the mocker publishes with its ``BlockStored`` events (computed once, kept)."""
        own, size = self._own, self.block_size
        start = len(own)
        if start < num_blocks:
            tokens = self.tokens[start * size : num_blocks * size]
            parent = own[-1] if own else self._hash_root
            if self._extra is None:
                own += router_hashes(tokens, size, parent)
            else:  # as ``media_block_hashes`` salts them (the router's request hashes)
                keys = [self._extra_key(i) for i in range(start, num_blocks)]
                own += salted_block_hashes(tokens, size, ROOT_SEED if parent is None else parent,
                                           keys)
        return own[:num_blocks]

    def sample(self) -> int:
        """The next token: uniform over the vocabulary, deterministic per (seed, prompt), and
        per (seed, original prompt) for a migrated request, which goes on as it would have.
        (``__init__`` replaces it with the same draw made with fewer calls.)"""
        return self._rng.randrange(self.vocab_size)

    def with_logprobs(self, chunk: LLMEngineOutput) -> LLMEngineOutput:
        """``chunk`` with made-up but well-formed logprobs of its tokens: each sampled token is
        the most likely (probability 0.3 to 0.9), its ``num_logprobs`` alternatives follow in
        descending order, and the probabilities sum to less than 1."""
        k = self.num_logprobs
        if k is None or not chunk.token_ids:
            return chunk
        log_probs: list[float] = []
        tops: list[list[tuple[int, float]]] = []
        for token in chunk.token_ids:
            lp, top = self._position(token, k)
            log_probs.append(lp)
            tops.append(top)
        chunk.log_probs = log_probs
        chunk.top_logprobs = tops
        return chunk

    def _position(self, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
        """One position's values (the same draws whatever the token, so a migrated request can
        skip the positions it replays)."""
        rng = self._lp_rng
        assert rng is not None  # num_logprobs is set
        p = rng.uniform(0.3, 0.9)
        lp = math.log(p)
        top = [(token, lp)] if k else []
        rest = 1.0 - p
        others = (t for t in rng.sample(range(self.vocab_size), k + 1) if t != token)
        for other in itertools.islice(others, max(0, k - 1)):
            p = min(rest * rng.uniform(0.1, 0.5), p * 0.99)
            rest -= p
            top.append((other, math.log(p)))
        return lp, top

    def append(self, token: int) -> str | None:
        """Add a generated token; returns the finish reason it causes, if any (vLLM's order:
        length first, then nothing before ``min_tokens``, then eos and stop tokens)."""
        tokens = self.tokens
        tokens.append(token)
        n = len(tokens) - self.num_prompt
        if n >= self.max_tokens:
            return FinishReason.LENGTH
        if n < self.min_tokens:
            return None
        if token in self.eos_token_ids or token in self.stop_token_ids:
            return FinishReason.STOP
        return None

    def usage(self) -> Usage:
        return Usage(self.num_prompt, self.num_output, self.cached_tokens or 0)

    def emit(self, chunk: LLMEngineOutput) -> None:
        """Queue a chunk for the stream and wake it."""
        self.outbox.append(chunk)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _Biased:
    """``Sequence.sample`` under a ``logit_bias``: the mocker's logits are all equal, so with the
    biases added token ``t`` has weight ``exp(bias[t])`` against 1 for every other token (a bias
    of 100 forces a token, -100 bans it), as a softmax over the biased logits gives."""

    def __init__(self, rng: random.Random, vocab_size: int, bias: dict[int, float]) -> None:
        self._rng = rng
        self._vocab = vocab_size
        self._tokens = [t for t in bias if 0 <= t < vocab_size]
        self._weights = list(itertools.accumulate(math.exp(bias[t]) for t in self._tokens))
        self._biased = frozenset(self._tokens)
        self._rest = vocab_size - len(self._biased)
        self._total = (self._weights[-1] if self._weights else 0.0) + self._rest

    def sample(self) -> int:
        rng = self._rng
        r = rng.random() * self._total
        weights = self._weights
        if weights and (r < weights[-1] or not self._rest):
            return self._tokens[min(bisect.bisect_right(weights, r), len(weights) - 1)]
        while True:  # uniform over the unbiased tokens (there are some: self._rest > 0)
            token = rng.randrange(self._vocab)
            if token not in self._biased:
                return token
