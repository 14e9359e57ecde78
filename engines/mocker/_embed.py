"""The mocker's deterministic embeddings (``--mock-embedding-dim``): a unit vector seeded by
the token ids, so equal inputs embed equally and different inputs differently."""

from __future__ import annotations

import hashlib
import math
import random
import struct

__all__ = ["mock_embedding"]


def mock_embedding(token_ids: list[int], dim: int) -> list[float]:
    """A unit-length vector of ``dim`` floats that depends only on ``token_ids``."""
    digest = hashlib.blake2b(struct.pack(f"<{len(token_ids)}q", *token_ids), digest_size=8)
    rng = random.Random(int.from_bytes(digest.digest(), "little"))
    vector = [rng.gauss(0.0, 1.0) for _ in range(dim)]
    norm = math.sqrt(sum(v * v for v in vector)) or 1.0
    return [v / norm for v in vector]
