"""One KV-event replay (or full dump) read from a worker's replay socket (vLLM's protocol; see
``router.subscriber``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from dynamo_zmq.transport import AsyncSocket, SendResult

__all__ = ["END_SEQ", "SNAPSHOT_SEQ", "MalformedReplay", "fetch_replay"]

log = logging.getLogger("router.subscriber")

#: Seq of the replay end marker (-1 as u64).
END_SEQ = 0xFFFFFFFFFFFFFFFF
#: Start seq of a full-dump request (-2 as u64): our publishers answer with every block they
#: hold, all batches carrying the seq of their last published one; others with the end marker.
SNAPSHOT_SEQ = 0xFFFFFFFFFFFFFFFE


class MalformedReplay(Exception):
    """A replay answer that is not ``[b"", topic, seq, payload]``."""

    def __init__(self, frames: int) -> None:
        super().__init__(f"malformed KV replay message ({frames} frames)")
        self.frames = frames


async def fetch_replay(sock: AsyncSocket, worker_id: int, start: int, timeout: float,
                       max_bytes: int, same_seq: bool = False) -> list[tuple[int, bytes]] | None:
    """Ask ``sock`` (a fresh DEALER) for the batches from ``start`` on; ``(seq, payload)`` in
    order, or None if the replay failed (timeout, a hole, over ``max_bytes``). ``same_seq``:
    a dump, whose batches all carry one seq.

    Raises:
        MalformedReplay: the publisher answered something else.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    got: list[tuple[int, bytes]] = []
    size = 0
    if sock.try_send([b"", start.to_bytes(8, "big")]) != SendResult.SENT:
        return None
    while True:
        frames = sock.recv_nowait()
        if frames is None:
            remaining = deadline - loop.time()
            if remaining <= 0:
                log.warning("worker %x: KV replay from %d timed out", worker_id, start)
                return None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await sock.wait_readable()
            continue
        if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != 8:
            raise MalformedReplay(len(frames))
        seq = int.from_bytes(frames[2], "big")
        if seq == END_SEQ:
            return got
        if got and seq != got[-1][0] + (0 if same_seq else 1):
            return None  # not contiguous: not a usable replay
        size += len(frames[3])
        if size > max_bytes:
            log.warning("worker %x: KV replay from %d over %d bytes; abandoned",
                        worker_id, start, max_bytes)
            return None
        got.append((seq, frames[3]))
