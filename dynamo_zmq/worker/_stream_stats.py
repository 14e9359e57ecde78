"""What ``engine.generate`` records over a stream's life, cheaply: one ``time.monotonic()`` per
chunk with tokens, kept in a list; TTFT and the inter-token latency statistics are computed
once, at the end."""

from __future__ import annotations

import itertools
import time
from typing import Any

__all__ = ["StreamStats"]


class StreamStats:
    """Chunk times and token counts of one stream (from its start)."""

    __slots__ = ("output_tokens", "start", "times")

    def __init__(self) -> None:
        self.start = time.monotonic()
        #: When each chunk with tokens arrived.
        self.times: list[float] = []
        self.output_tokens = 0

    def note(self, tokens: int) -> None:
        """A chunk of ``tokens`` (> 0) token ids arrived now."""
        self.times.append(time.monotonic())
        self.output_tokens += tokens

    def attributes(self) -> dict[str, Any]:
        """``ttft_ms``, ``output_tokens`` and, with two chunks or more, ``avg_itl_ms``,
        ``itl_p50_ms``, ``itl_p99_ms`` and ``itl_max_ms`` (between chunks with tokens)."""
        times = self.times
        attrs: dict[str, Any] = {"output_tokens": self.output_tokens}
        if not times:
            return attrs
        attrs["ttft_ms"] = (times[0] - self.start) * 1e3
        if len(times) > 1:
            gaps = sorted((b - a) * 1e3 for a, b in itertools.pairwise(times))
            n = len(gaps)
            attrs["avg_itl_ms"] = sum(gaps) / n
            attrs["itl_p50_ms"] = gaps[min(n - 1, int(0.50 * n))]
            attrs["itl_p99_ms"] = gaps[min(n - 1, int(0.99 * n))]
            attrs["itl_max_ms"] = gaps[-1]
        return attrs
