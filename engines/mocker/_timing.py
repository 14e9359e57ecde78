"""The mocker's step-time model (Dynamo's mocker): a quadratic prefill cost in the new prompt
tokens of the step (or a flat cost per token, ``--prefill-ms-per-token``), plus a decode cost
that grows with KV-cache usage."""

from __future__ import annotations

__all__ = ["decode_ms", "prefill_ms", "step_seconds"]


def prefill_ms(new_tokens: int, per_token_ms: float = 0.0) -> float:
    """Milliseconds to prefill ``new_tokens`` uncached prompt tokens (0 when there are none):
    Dynamo's fit, or ``per_token_ms * new_tokens`` when ``per_token_ms > 0`` (a linear cost
    with no fixed part, so a prefix hit saves time in proportion to the tokens it covers)."""
    if new_tokens <= 0:
        return 0.0
    if per_token_ms > 0:
        return per_token_ms * new_tokens
    t = float(new_tokens)
    return 4.209989e-7 * t * t + 1.518344e-2 * t + 16.50142


def decode_ms(kv_usage: float) -> float:
    """Milliseconds of one decode step at ``kv_usage`` (active blocks / total), at least 1."""
    u = kv_usage
    return max(1.0, -25.74 * u * u + 54.01 * u + 5.74)


def step_seconds(
    prefill_tokens: int,
    decoding: int,
    kv_usage: float,
    speedup_ratio: float,
    per_token_ms: float = 0.0,
) -> float:
    """Simulated duration of one scheduler step, in seconds (``per_token_ms``: see
    ``prefill_ms``)."""
    ms = prefill_ms(prefill_tokens, per_token_ms)
    if decoding:
        ms += decode_ms(kv_usage)
    return ms / speedup_ratio / 1000.0
