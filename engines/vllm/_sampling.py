"""Our request and output types <-> vLLM's: ``SamplingParams`` from a ``PreprocessedRequest``,
and ``LLMEngineOutput`` chunks from vLLM's ``RequestOutput`` deltas."""

from __future__ import annotations

from typing import Any

from dynamo_zmq import errors
from dynamo_zmq.llm import FinishReason, LLMEngineOutput, PreprocessedRequest, Usage

__all__ = ["finish_reason", "sampling_params", "to_output"]

#: vLLM's finish reasons (``vllm.v1.engine.FinishReason`` as strings) -> ours.
_FINISH = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.CANCELLED,
    "error": FinishReason.ERROR,
    "repetition": FinishReason.STOP,
}


def sampling_params(request: PreprocessedRequest, native: bool) -> Any:
    """vLLM ``SamplingParams`` (``output_kind=DELTA``) for ``request``.

    On the fast path the worker detokenizes and applies stop strings, so vLLM gets neither; with
    ``native`` (or a request asking for ``output.detokenize``) vLLM does both.

    Raises:
        InvalidArgument: vLLM rejects the options (its ``ValueError``/``TypeError``).
    """
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import RequestOutputKind

    s, stop, out = request.sampling, request.stop, request.output
    detokenize = native or out.detokenize
    kwargs: dict[str, Any] = {
        "n": 1,
        "max_tokens": stop.max_tokens,
        "min_tokens": stop.min_tokens,
        "ignore_eos": stop.ignore_eos,
        "skip_special_tokens": out.skip_special_tokens,
        "include_stop_str_in_output": stop.include_stop_str_in_output,
        "detokenize": detokenize,
        "output_kind": RequestOutputKind.DELTA,
    }
    stop_ids = list(stop.stop_token_ids)
    if not stop.ignore_eos:
        # vLLM knows the model's EOS; the frontend's may add ids (e.g. generation_config's list).
        stop_ids += [t for t in request.eos_token_ids if t not in stop_ids]
    if stop_ids:
        kwargs["stop_token_ids"] = stop_ids
    if detokenize and stop.stop:
        kwargs["stop"] = list(stop.stop)
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                 "frequency_penalty", "repetition_penalty"):
        value = getattr(s, name)
        if value is not None:
            kwargs[name] = value
    if s.n != 1:
        raise errors.InvalidArgument(f"n={s.n} is not supported (one sequence per request)")
    if out.logprobs is not None:
        kwargs["logprobs"] = out.logprobs
    if s.logit_bias:
        kwargs["logit_bias"] = dict(s.logit_bias)
    try:
        return SamplingParams(**kwargs)
    except (VLLMValidationError, ValueError, TypeError) as exc:
        raise errors.InvalidArgument(f"vLLM rejected the sampling options: {exc}") from exc


def finish_reason(reason: Any) -> str:
    """Our finish reason for vLLM's (a string, or an enum whose ``str`` is one)."""
    return _FINISH.get(str(reason), FinishReason.ERROR)


def to_output(
    out: Any, prompt_tokens: int, completion_tokens: int, detokenize: bool
) -> tuple[LLMEngineOutput | None, int]:
    """One chunk from one vLLM ``RequestOutput`` delta, and the completion tokens so far.

    Returns None for a non-final delta that carries nothing (vLLM may send empty deltas).
    """
    comp = out.outputs[0] if out.outputs else None
    ids = list(comp.token_ids) if comp is not None else []
    completion_tokens += len(ids)
    text = (comp.text or "") if detokenize and comp is not None else None
    log_probs = None
    if comp is not None and comp.logprobs:
        log_probs = [
            float(step[token].logprob)
            for step, token in zip(comp.logprobs, ids, strict=False)
            if token in step
        ] or None
    if not out.finished:
        if not ids and not text:
            return None, completion_tokens
        return LLMEngineOutput(ids, text=text, log_probs=log_probs), completion_tokens
    reason = finish_reason(comp.finish_reason) if comp is not None else FinishReason.ERROR
    cached = getattr(out, "num_cached_tokens", None)
    usage = Usage(prompt_tokens, completion_tokens, cached if isinstance(cached, int) else None)
    error = "vLLM ended the request with an error" if reason == FinishReason.ERROR else None
    # vLLM names the stop string or stop token id that ended a "stop" (None: end of sequence).
    stop_reason = getattr(comp, "stop_reason", None)
    if isinstance(stop_reason, bool) or not isinstance(stop_reason, (int, str)):
        stop_reason = None
    return (
        LLMEngineOutput(
            ids, text=text, finish_reason=reason, usage=usage, error=error, log_probs=log_probs,
            stop_reason=stop_reason,
        ),
        completion_tokens,
    )
