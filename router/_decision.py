"""``Decision``: where the KV router sends a request, and why (``KvRouter.best_worker``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from .scheduler import Candidate

__all__ = ["Decision"]


@dataclasses.dataclass(frozen=True)
class Decision:
    """Where a request goes and why."""

    worker_id: int
    dp_rank: int
    overlap_blocks: int
    prompt_blocks: int
    #: Matched prefix blocks per candidate (only those with a match).
    matches: dict[Candidate, int]
    cost: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The ``best_worker`` answer: ids as ints, matches keyed ``"<worker hex>/<rank>"``."""
        return {
            "worker_id": self.worker_id,
            "dp_rank": self.dp_rank,
            "overlap_blocks": self.overlap_blocks,
            "prompt_blocks": self.prompt_blocks,
            "matches": {f"{w:x}/{r}": n for (w, r), n in sorted(self.matches.items())},
        }
