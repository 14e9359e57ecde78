"""One request in the mocker's terms: why it cannot run (``request_problem``), and the
``Sequence`` a rank's scheduler runs for it (``new_sequence``)."""

from __future__ import annotations

from dynamo_zmq.llm import PreprocessedRequest
from dynamo_zmq.llm._media_keys import check_media

from ._config import MockerConfig
from ._sequence import Sequence

__all__ = ["media_problem", "new_sequence", "request_problem"]


def request_problem(cfg: MockerConfig, request: PreprocessedRequest, num_ranks: int) -> str | None:
    """Why ``request`` cannot run on a running mocker of ``num_ranks`` ranks, or None."""
    prompt = request.token_ids
    if not prompt:
        return "the prompt is empty"
    if len(prompt) >= cfg.context_length:
        return (f"the prompt has {len(prompt)} tokens but the context length is "
                f"{cfg.context_length} (at most {cfg.context_length - 1} prompt tokens)")
    if min(prompt) < 0 or max(prompt) >= cfg.vocab_size:
        return f"prompt token ids must be in [0, {cfg.vocab_size})"
    if -(-len(prompt) // cfg.block_size) > cfg.num_gpu_blocks:
        return (f"the prompt needs {-(-len(prompt) // cfg.block_size)} KV blocks; "
                f"a rank has {cfg.num_gpu_blocks}")
    max_tokens = request.stop.max_tokens
    if max_tokens is not None and max_tokens < 1:
        return f"max_tokens must be at least 1, got {max_tokens}"
    rank = request.routing.dp_rank
    if rank is not None and not 0 <= rank < num_ranks:
        return (f"dp_rank {rank} out of range: this engine serves ranks "
                f"0..{num_ranks - 1}")
    return None


def media_problem(cfg: MockerConfig, request: PreprocessedRequest) -> str | None:
    """Why ``request.media`` cannot run here (None: it can): a mocker without
    ``--tokens-per-image`` takes no images; each image's run must be ``tokens_per_image``
    copies of its image token, inside the prompt, in order (``check_media``)."""
    media = request.media
    if not media:
        return None
    if not cfg.tokens_per_image:
        return "this mocker takes no images (start it with --tokens-per-image N)"
    for i, item in enumerate(media):
        if item.length != cfg.tokens_per_image:
            return (f"media[{i}] takes {item.length} tokens; this mocker's images take "
                    f"{cfg.tokens_per_image}")
    return check_media(media, request.token_ids, cfg.image_token)


def new_sequence(cfg: MockerConfig, request: PreprocessedRequest) -> Sequence:
    """The sequence that generates ``request``'s output (a checked request)."""
    room = cfg.context_length - len(request.token_ids)
    stop = request.stop
    return Sequence(
        request.token_ids,
        block_size=cfg.block_size,
        vocab_size=cfg.vocab_size,
        seed=cfg.seed if request.sampling.seed is None else request.sampling.seed,
        max_tokens=room if stop.max_tokens is None else min(stop.max_tokens, room),
        min_tokens=stop.min_tokens,
        stop_token_ids=stop.stop_token_ids,
        eos_token_ids=(*request.eos_token_ids, *cfg.eos_token_ids),
        ignore_eos=stop.ignore_eos,
        request_id=request.request_id,
        resumed=request.resume.generated if request.resume is not None else 0,
        num_logprobs=request.output.logprobs,
        logit_bias=request.sampling.logit_bias,
        hash_root=cfg.kv_hash_seed,
        lora_name=request.lora_name,
        media=request.media,
    )
