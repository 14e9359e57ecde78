"""The mocker's disaggregated prefill and decode over ``dynamo_zmq.kv_transfer``.

The mocker has no real KV, so a block's payload is what identifies its content: the block's
chained hash (8 bytes, little-endian; 0 for the prompt's last, partial block) followed by its
token ids (uint32). The decode side checks every block against its own prompt, so a transfer of
the wrong KV is caught and prefilled locally instead. The bytes a real engine would move
(``kv_bytes_per_token`` per prompt token) are what the transfer holds against the server's
``max_bytes`` and what the decode side's modeled transfer time is computed from
(``kv_transfer_bandwidth``, divided by ``speedup_ratio`` like every simulated time): each batch
is acknowledged only after its share of that time, so the pull runs at the modeled pace.
"""

from __future__ import annotations

import array
import asyncio
import logging

from dynamo_zmq import errors
from dynamo_zmq.context import Context
from dynamo_zmq.kv_transfer import (
    KvTransferClient,
    KvTransferServer,
    Ticket,
    TransferFailed,
    TransferFull,
)

from ._config import MockerConfig
from ._scheduler import RankScheduler
from ._sequence import Sequence

__all__ = ["DisaggStats", "block_payloads", "offer_prompt_kv", "pull_prompt_kv"]

log = logging.getLogger("engines.mocker")


class DisaggStats:
    """Counts of the mocker's disaggregated work (its ``mocker_*`` metrics)."""

    def __init__(self) -> None:
        self.handoffs = 0
        self.remote_prefills = 0
        self.remote_blocks = 0
        self.fallbacks = 0
        self.modeled_seconds = 0.0


def block_payloads(seq: Sequence) -> list[bytes]:
    """One payload per block of ``seq``'s prompt (see the module docstring)."""
    size = seq.block_size
    prompt = seq.tokens[: seq.num_prompt]
    hashes = seq.block_hashes(len(prompt) // size)
    out = []
    for i in range(-(-len(prompt) // size)):
        h = hashes[i] if i < len(hashes) else 0
        out.append(h.to_bytes(8, "little") + array.array("I", prompt[i * size:(i + 1) * size])
                   .tobytes())
    return out


def offer_prompt_kv(server: KvTransferServer, sched: RankScheduler, seq: Sequence,
                    cfg: MockerConfig, stats: DisaggStats) -> Ticket | None:
    """Offer the prompt's KV of a finished prefill-role ``seq`` (its blocks held): the ticket,
    or None when there is nothing to hand off (the blocks are then released at once)."""
    if not seq.block_ids:
        return None
    try:
        ticket = server.offer(
            block_payloads(seq), num_bytes=seq.num_prompt * cfg.kv_bytes_per_token,
            on_release=lambda _reason: sched.release_held(seq),
        )
    except TransferFull as exc:
        log.warning("no KV handoff for request %s: %s", seq.request_id, exc.message)
        sched.release_held(seq)
        return None
    stats.handoffs += 1
    return ticket


async def pull_prompt_kv(client: KvTransferClient, ticket: Ticket, seq: Sequence,
                         cfg: MockerConfig, ctx: Context, stats: DisaggStats) -> bool:
    """Pull the prompt's KV ``ticket`` names, at the modeled bandwidth.
    True: ``seq`` is marked to skip its prefill; False: it prefills locally (logged).

    Raises:
        Cancelled: ``ctx`` was stopped meanwhile.
    """
    expected = block_payloads(seq)
    try:
        if ticket.num_blocks != len(expected):
            raise TransferFailed(f"the handoff has {ticket.num_blocks} blocks, the prompt "
                                 f"{len(expected)}")
        seconds_per_block = (ticket.num_bytes / max(1, ticket.num_blocks)
                             / (cfg.kv_transfer_bandwidth * 1e9) / cfg.speedup_ratio)
        got = 0
        async for batch in client.pull(ticket, ctx):
            for payload in batch:
                if got >= len(expected) or payload != expected[got]:
                    raise TransferFailed(f"KV block {got} does not match the prompt")
                got += 1
            delay = seconds_per_block * len(batch)
            stats.modeled_seconds += delay
            await asyncio.sleep(delay)
        if got != len(expected):
            raise TransferFailed(f"{got} KV blocks pulled of {len(expected)}")
    except errors.Cancelled:
        raise
    except errors.DynamoError as exc:
        stats.fallbacks += 1
        log.warning("KV pull for request %s failed, prefilling locally: %s: %s",
                    seq.request_id, exc.kind, exc.message)
        return False
    stats.remote_prefills += 1
    stats.remote_blocks += got
    seq.remote_kv = True
    return True
