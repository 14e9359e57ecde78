"""Our request and output types <-> vLLM's: ``SamplingParams`` from a ``PreprocessedRequest``,
and ``LLMEngineOutput`` chunks from vLLM's ``RequestOutput`` deltas."""

from __future__ import annotations

from typing import Any

from dynamo_zmq import errors
from dynamo_zmq.llm import (
    FinishReason,
    GuidedDecoding,
    LLMEngineOutput,
    PreprocessedRequest,
    Usage,
)

from ._kv_params import handoff_of, kv_transfer_params

__all__ = ["finish_reason", "sampling_params", "structured_outputs", "to_output"]

#: vLLM's finish reasons (``vllm.v1.engine.FinishReason`` as strings) -> ours.
_FINISH = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.CANCELLED,
    "error": FinishReason.ERROR,
    "repetition": FinishReason.STOP,
}


def sampling_params(request: PreprocessedRequest, native: bool, kv_transfer: bool = False) -> Any:
    """vLLM ``SamplingParams`` (``output_kind=DELTA``) for ``request``.

    On the fast path the worker detokenizes and applies stop strings, so vLLM gets neither; with
    ``native`` (or a request asking for ``output.detokenize``) vLLM does both. With
    ``kv_transfer`` (a prefill or decode worker), the request's ``disaggregation`` goes to
    vLLM's KV connector as ``kv_transfer_params`` (``_kv_params``).

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
    if out.prompt_logprobs is not None:
        kwargs["prompt_logprobs"] = out.prompt_logprobs
    if s.logit_bias:
        kwargs["logit_bias"] = dict(s.logit_bias)
    if kv_transfer and request.disaggregation is not None:
        params = kv_transfer_params(request.disaggregation)
        if params is not None:
            kwargs["extra_args"] = {"kv_transfer_params": params}
    try:
        if request.guided is not None:
            kwargs["structured_outputs"] = structured_outputs(request.guided)
        return SamplingParams(**kwargs)
    except (VLLMValidationError, ValueError, TypeError) as exc:
        raise errors.InvalidArgument(f"vLLM rejected the sampling options: {exc}") from exc


def structured_outputs(guided: GuidedDecoding) -> Any:
    """vLLM's ``StructuredOutputsParams`` for our constraint (vLLM refuses none or several:
    ``VLLMValidationError``; a schema or regex its backend cannot compile fails later, when the
    request is added)."""
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(
        json=guided.json_schema, regex=guided.regex, choice=guided.choice,
        grammar=guided.grammar, json_object=True if guided.json_object else None,
    )


def finish_reason(reason: Any) -> str:
    """Our finish reason for vLLM's (a string, or an enum whose ``str`` is one)."""
    return _FINISH.get(str(reason), FinishReason.ERROR)


def to_output(
    out: Any, prompt_tokens: int, completion_tokens: int, detokenize: bool,
    num_logprobs: int | None = None,
) -> tuple[LLMEngineOutput | None, int]:
    """One chunk from one vLLM ``RequestOutput`` delta, and the completion tokens so far
    (``num_logprobs``: the request's ``output.logprobs``).

    Returns None for a non-final delta that carries nothing (vLLM may send empty deltas).
    """
    comp = out.outputs[0] if out.outputs else None
    ids = list(comp.token_ids) if comp is not None else []
    completion_tokens += len(ids)
    text = (comp.text or "") if detokenize and comp is not None else None
    log_probs = top = texts = None
    if comp is not None and comp.logprobs:
        log_probs, top, texts = _logprobs(comp.logprobs, ids, num_logprobs or 0, detokenize)
    prompt = prompt_texts = None
    if getattr(out, "prompt_logprobs", None):
        prompt, prompt_texts = _prompt_logprobs(out.prompt_logprobs, detokenize)
    if not out.finished:
        if not ids and not text and prompt is None:
            return None, completion_tokens
        return (
            LLMEngineOutput(
                ids, text=text, log_probs=log_probs, top_logprobs=top, logprob_texts=texts,
                prompt_logprobs=prompt, prompt_logprob_texts=prompt_texts,
            ),
            completion_tokens,
        )
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
            stop_reason=stop_reason, top_logprobs=top, logprob_texts=texts,
            prompt_logprobs=prompt, prompt_logprob_texts=prompt_texts,
            kv_handoff=handoff_of(getattr(out, "kv_transfer_params", None)),
        ),
        completion_tokens,
    )


def _logprobs(
    steps: Any, ids: list[int], k: int, detokenize: bool
) -> tuple[list[float], list[list[tuple[int, float]]] | None, list[list[str]] | None]:
    """Our ``log_probs``, ``top_logprobs`` and (when vLLM detokenizes: native processing)
    ``logprob_texts`` from vLLM's per-token dicts (token id -> ``Logprob``; the sampled token
    first, then ranks 1..k): the sampled token's value, and the top ``k`` by rank (None when
    ``k`` is 0). Values are vLLM's own (its ``logprobs_mode``, raw by default, as its server
    returns them)."""
    log_probs: list[float] = []
    top: list[list[tuple[int, float]]] = []
    texts: list[list[str]] = []
    for step, token in zip(steps, ids, strict=False):
        sampled = step[token]
        log_probs.append(float(sampled.logprob))
        ranked = sorted(
            (lp.rank, tid, lp) for tid, lp in step.items()
            if tid != token and lp.rank is not None and lp.rank <= k
        )
        if sampled.rank is not None and sampled.rank <= k:
            ranked = sorted([*ranked, (sampled.rank, token, sampled)])
        top.append([(tid, float(lp.logprob)) for _, tid, lp in ranked])
        if detokenize:
            texts.append([sampled.decoded_token or "",
                          *(lp.decoded_token or "" for _, _, lp in ranked)])
    return log_probs, top if k else None, texts if detokenize else None


def _prompt_logprobs(
    positions: Any, detokenize: bool
) -> tuple[list[list[tuple[int, float, int]]], list[list[str]] | None]:
    """Our ``prompt_logprobs`` (and, when vLLM detokenizes, ``prompt_logprob_texts``) from
    vLLM's ``RequestOutput.prompt_logprobs``: per prompt token None (the first) or a dict
    token id -> ``Logprob`` with the prompt token first, then the top alternatives by rank."""
    out: list[list[tuple[int, float, int]]] = []
    texts: list[list[str]] = []
    for step in positions:
        if step is None:
            out.append([])
            texts.append([""])
            continue
        out.append([(int(tid), float(lp.logprob), int(lp.rank or 0)) for tid, lp in step.items()])
        texts.append([lp.decoded_token or "" for lp in step.values()])
    return out, texts if detokenize else None
