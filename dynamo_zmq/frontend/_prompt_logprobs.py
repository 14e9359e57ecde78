"""Prompt logprobs (vLLM's ``prompt_logprobs``, and completions' ``echo`` with ``logprobs``):
the request's check, and the ``prompt_logprobs`` field in vLLM's server's shape.

The field is a list with one entry per prompt token: ``null`` for the first (nothing precedes
it), then ``{"<token id>": {"logprob": ..., "rank": ..., "decoded_token": ...}}`` with the prompt
token first and the top alternatives after it (``-inf`` written as -9999.0). vLLM's server puts
it on each completions choice and at the top of a chat response; it refuses it when streaming.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..llm import Capability, LLMEngineOutput
from .errors import bad_request, unsupported

__all__ = ["MAX_PROMPT_LOGPROBS", "asked_prompt_logprobs", "check_prompt_logprobs",
           "prompt_logprobs_field"]

#: Most alternatives per prompt token (vLLM's default ``max_logprobs``).
MAX_PROMPT_LOGPROBS = 20
_FLOOR = -9999.0


def check_prompt_logprobs(value: int | None, stream: bool) -> None:
    """Refuse a ``prompt_logprobs`` vLLM's server would refuse (or we do not serve).

    Raises:
        HttpError: 400 for -1 (the whole vocabulary), a value outside 0..20, or one above 0
            with ``stream``.
    """
    if value is None:
        return
    if value == -1:
        raise unsupported("prompt_logprobs", "-1 (the whole vocabulary)")
    if not 0 <= value <= MAX_PROMPT_LOGPROBS:
        raise bad_request(
            f"'prompt_logprobs' must be at least 0 and at most {MAX_PROMPT_LOGPROBS}, got "
            f"{value}", param="prompt_logprobs", code="invalid_value",
        )
    if stream and value > 0:
        raise bad_request("'prompt_logprobs' are not available when 'stream' is true",
                          param="prompt_logprobs", code="invalid_value")


def asked_prompt_logprobs(req: Any, require: Callable[[str, str], None] | None) -> int | None:
    """``OutputOptions.prompt_logprobs`` for a parsed chat or completion request: its
    ``prompt_logprobs``, else (completions' ``echo`` with ``logprobs``) its ``logprobs``, as
    vLLM's server asks; checked against the serving engine with ``require``.

    Raises:
        HttpError: 400 naming the engine when it lacks ``Capability.PROMPT_LOGPROBS``.
    """
    value: int | None = req.prompt_logprobs
    param = "prompt_logprobs"
    if value is None and req.echo and req.logprobs is not None:  # chat's echo is refused
        value, param = req.logprobs, "echo"
    if value is not None and require is not None:
        require(Capability.PROMPT_LOGPROBS, param)
    return value


def prompt_logprobs_field(out: LLMEngineOutput) -> list[dict[str, Any] | None]:
    """The ``prompt_logprobs`` field from the output that carries them."""
    positions = out.prompt_logprobs or []
    texts = out.prompt_logprob_texts or []
    field: list[dict[str, Any] | None] = []
    for i, entries in enumerate(positions):
        if not entries:
            field.append(None)
            continue
        names = texts[i] if i < len(texts) else []
        field.append({
            str(tid): {"logprob": max(lp, _FLOOR), "rank": rank,
                       "decoded_token": names[j] if j < len(names) else None}
            for j, (tid, lp, rank) in enumerate(entries)
        })
    return field
