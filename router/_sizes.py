"""A request's size in the KV router's units: the prompt tokens still to prefill on the
chosen (worker, rank), and the KV blocks its output is expected to fill (its predicted load)."""

from __future__ import annotations

import math

from dynamo_zmq.llm import PreprocessedRequest

__all__ = ["expected_output_blocks", "prefill_tokens"]


def prefill_tokens(request: PreprocessedRequest, overlap_blocks: int, block_size: int) -> int:
    """The prompt tokens not already cached in the ``overlap_blocks`` the choice holds."""
    return max(0, len(request.token_ids) - overlap_blocks * block_size)


def expected_output_blocks(request: PreprocessedRequest, block_size: int, cap: int) -> int:
    """The blocks ``request``'s output fills: ``max_tokens`` tokens, at most ``cap``
    (``max_expected_output_tokens``)."""
    max_tokens = request.stop.max_tokens
    tokens = cap if max_tokens is None else min(max_tokens, cap)
    # The prompt's partial last block fills up first.
    partial = len(request.token_ids) % block_size
    return max(0, math.ceil((partial + tokens) / block_size))
