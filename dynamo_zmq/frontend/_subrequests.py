"""A generation request's sub-requests (``FanOut`` sends and merges them): a plain request's
one, as preprocessing made it; for several sequences (``n > 1``, ``best_of``, ``echo``, a batch
of prompts) one ``PreprocessedRequest`` per sequence, ``sampling.n = 1``, sequence ``j`` of a
prompt seeded ``seed + j``; and which of them ``best_of`` keeps."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import msgspec

from ..llm import Capability, PreprocessedRequest, RoutingHints
from ._logprobs import ChoiceLogprobs
from ._tools import apply_tools
from .models import ModelEntry
from .preprocess import Preprocessor, Require
from .protocol import ChatCompletionRequest, CompletionRequest, prompts

__all__ = [
    "SubRequest",
    "best_choices",
    "chat_work",
    "completion_prompts",
    "completion_work",
    "fan_out",
]

_I64 = 2**64
_I64_MAX = 2**63 - 1


@dataclasses.dataclass(slots=True, eq=False)
class SubRequest:
    """One sequence of a fanned-out request and what it produced."""

    #: The choice index (with ``best_of > n``: set once the best are chosen).
    index: int
    #: Which prompt (of a batch) and which of its sequences.
    prompt: int
    number: int
    pre: PreprocessedRequest
    #: Text put before the choice's own (``echo``: the prompt).
    echo: str = ""
    texts: list[str] = dataclasses.field(default_factory=list)
    tokens: int = 0
    usage_tokens: int | None = None
    cached: int | None = None
    #: Cumulative log-probability of the sampled tokens (``best_of``).
    score: float = 0.0
    finish: str | None = None
    stop_reason: int | str | None = None
    last: float = 0.0
    #: The choice's logprobs, when the request asked for them.
    logprobs: ChoiceLogprobs | None = None
    #: Reasoning text and tool calls parsed by the worker (chat with tools or a reasoning
    #: parser), gathered for an aggregated response.
    thoughts: list[str] = dataclasses.field(default_factory=list)
    calls: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)

    @property
    def completion_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.tokens


def _seed(seed: int | None, j: int) -> int | None:
    if seed is None:
        return None
    seed += j
    return seed - _I64 if seed > _I64_MAX else seed


def fan_out(
    prompts: Sequence[tuple[PreprocessedRequest, str]], n: int, best_of: int
) -> list[SubRequest]:
    """The sub-requests of ``best_of`` (>= ``n``) sequences per prompt (each prompt's request
    and its echo text)."""
    subs: list[SubRequest] = []
    replace = msgspec.structs.replace
    for p, (pre, echo) in enumerate(prompts):
        output = pre.output
        if best_of > n and output.logprobs is None:
            output = replace(output, logprobs=0)  # the sampled tokens' log-probs rank them
        for j in range(best_of):
            sampling = replace(pre.sampling, n=1, seed=_seed(pre.sampling.seed, j))
            sub = replace(pre, sampling=sampling, output=output, routing=RoutingHints())
            subs.append(SubRequest(p * n + j, p, j, sub, echo))
    return subs


def completion_prompts(
    preprocessor: Preprocessor, req: CompletionRequest, require: Require | None = None
) -> list[tuple[PreprocessedRequest, str]]:
    """Each prompt of a completions request preprocessed, with its text for ``echo`` (the
    prompt as given, or its token ids decoded; empty without ``echo``); ``require`` as for
    ``Preprocessor.completion``."""
    out = []
    for prompt in prompts(req):
        pre = preprocessor.completion(msgspec.structs.replace(req, prompt=prompt), require)
        echo = ""
        if req.echo:
            echo = prompt if isinstance(prompt, str) else preprocessor.tokenizer.decode(
                prompt, skip_special_tokens=req.skip_special_tokens is not False
            )
        out.append((pre, echo))
    return out


def completion_work(entry: ModelEntry, req: CompletionRequest) -> tuple[list[SubRequest], int]:
    """A completion's sub-requests (one; or one per sequence with several prompts, ``n``,
    ``best_of`` or ``echo``), and its choices per prompt.

    Raises:
        HttpError: 400 for what the serving engine lacks (``best_of`` needs logprobs, ``echo``
            with ``logprobs`` prompt logprobs), or what preprocessing refuses.
    """
    n = req.n or 1
    best_of = req.best_of or n
    prompt = req.prompt
    one_prompt = isinstance(prompt, str) or isinstance(prompt[0], int)
    if n == 1 and best_of == 1 and not req.echo and one_prompt:
        return [SubRequest(0, 0, 0, entry.preprocessor.completion(req, entry.require))], 1
    if best_of > n:
        entry.require(Capability.LOGPROBS, "best_of")
    if req.echo and req.logprobs is not None:
        entry.require(Capability.PROMPT_LOGPROBS, "echo")
    return fan_out(completion_prompts(entry.preprocessor, req, entry.require), n, best_of), n


def chat_work(entry: ModelEntry, req: ChatCompletionRequest,
              images: Sequence[bytes] = ()) -> tuple[list[SubRequest], int]:
    """A chat request's sub-requests (its tools applied, its ``images`` expanded as the engine
    takes them): one, or ``n``; and its choices.

    Raises:
        HttpError: what preprocessing refuses.
    """
    work = entry.preprocessor.chat(req, entry.require, images, entry.vision)
    apply_tools(req, entry, work)
    if req.n is not None and req.n > 1:
        return fan_out([(work, "")], req.n, req.n), req.n
    return [SubRequest(0, 0, 0, work)], 1


def best_choices(subs: list[SubRequest], n: int, best_of: int) -> list[SubRequest]:
    """The sub-requests whose choices are returned: all, or with ``best_of > n`` the ``n`` of
    each prompt with the highest score, indexed best first."""
    if best_of == n:
        return subs
    chosen: list[SubRequest] = []
    for p in range(len(subs) // best_of):
        group = subs[p * best_of : (p + 1) * best_of]
        best = sorted(group, key=lambda s: (-s.score, s.number))[:n]
        for rank, sub in enumerate(best):
            sub.index = p * n + rank
        chosen += best
    return chosen
