"""Session-affinity calls for tests: completions of model 'tiny' through the real ``openai``
client, naming a session in ``x-dynamo-session-id``, and the frontend's session metrics."""

from __future__ import annotations

import random

from openai import OpenAI

from tests.support.metrics import fetch_sample

__all__ = ["session_counts", "session_worker", "tokens"]


def tokens(seed: int, n: int = 32) -> list[int]:
    """A prompt of ``n`` token ids no other seed shares a prefix with (almost surely)."""
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


def session_worker(url: str, session: str | None, prompt: list[int], max_tokens: int = 4,
                   n: int = 1, header: str = "x-dynamo-session-id") -> str:
    """A completion in ``session`` (None: none; ``header`` names it): the worker (hex) that
    served it, from ``x-dynamo-worker`` (each sub-request's, comma-separated, for ``n`` > 1:
    ranks dropped, duplicates kept once)."""
    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, n=n,
        extra_headers={header: session} if session is not None else None,
        extra_body={"ignore_eos": True},
    )
    body = raw.parse()
    assert len(body.choices) == n
    served = raw.headers["x-dynamo-worker"].split(",")
    return ",".join(dict.fromkeys(s.split("/")[0] for s in served))


async def session_counts(url: str, model: str = "tiny") -> dict[str, float]:
    """The frontend's session metrics for ``model``: pinned, new, moved_busy, moved_lost,
    expired, evicted (counters) and live (the gauge)."""
    prefix = "dynamo_router_session"
    return {
        "pinned": await fetch_sample(url, f"{prefix}_pinned_total", model=model),
        "new": await fetch_sample(url, f"{prefix}_new_total", model=model),
        "moved_busy": await fetch_sample(url, f"{prefix}_moved_total", model=model,
                                         reason="busy"),
        "moved_lost": await fetch_sample(url, f"{prefix}_moved_total", model=model,
                                         reason="lost"),
        "expired": await fetch_sample(url, f"{prefix}_expired_total", model=model),
        "evicted": await fetch_sample(url, f"{prefix}_evicted_total", model=model),
        "live": await fetch_sample(url, "dynamo_router_sessions", model=model),
    }
