"""``KvTransferServer``: a prefill worker holds KV blocks for a decode worker to pull.

One ROUTER socket. ``offer`` registers a transfer (its blocks, and the bytes it holds) and
returns the ticket the decode worker needs; the transfer waits for its pull at most ``ttl``
seconds (then it expires: dropped and counted), and all transfers together hold at most
``max_bytes`` (an offer beyond it raises ``TransferFull``). A pull gets the blocks in batches of
``batch_blocks``, never more than the client's credit unacknowledged; the transfer is released
when the last batch is acknowledged, when the client releases it, or when it stalls for ``ttl``.
Malformed frames are counted and ignored (``transport.BadInput``): garbage never ends the loop.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable, Sequence

import msgspec
import zmq

from ..resources import Resources
from ..transport import AsyncSocket, BadInput, Domain, SendResult, current_curve, make_socket
from ._config import KvTransferConfig
from ._errors import TransferFull
from ._messages import Ack, Batch, Failure, Pull, Release, Ticket, decode_client, encode
from ._metrics import KvTransferMetrics

__all__ = ["KvTransferServer", "OnRelease"]

log = logging.getLogger(__name__)

OnRelease = Callable[[str], object]
"""Called once when a transfer is released, with why: ``pulled``, ``released`` (the client gave
it up), ``expired``, ``gone`` (the client vanished) or ``closed`` (the server shut down)."""


class _Held:
    __slots__ = ("acked", "blocks", "credit", "deadline", "next_block", "num_bytes",
                 "on_release", "peer", "sent")

    def __init__(self, blocks: list[bytes], num_bytes: int, on_release: OnRelease | None,
                 deadline: float) -> None:
        self.blocks = blocks
        self.num_bytes = num_bytes
        self.on_release = on_release
        self.deadline = deadline
        self.peer: bytes | None = None
        self.credit = 0
        self.next_block = 0
        self.sent = 0  # batches sent
        self.acked = 0  # batches acknowledged


class KvTransferServer:
    """Holds offered transfers and serves their pulls (see the module docstring).

    Args:
        config: limits and batch size.
        bind_host: where the ROUTER binds (``*`` for every interface).
        advertise_host: the address put in tickets (default: ``bind_host``).
        hosts: every address it is reached at, when ``bind_host`` is a wildcard on a host with
            several (tickets name them all, for decode workers on other networks).
        metrics: where to count (default: metrics of its own).
    """

    def __init__(self, config: KvTransferConfig | None = None, *, bind_host: str = "127.0.0.1",
                 advertise_host: str | None = None, hosts: Sequence[str] = (),
                 metrics: KvTransferMetrics | None = None) -> None:
        self.config = config or KvTransferConfig()
        self.metrics = metrics or KvTransferMetrics()
        self._bind_host = bind_host
        self._advertise = advertise_host or bind_host
        self._hosts = tuple(hosts) if len(hosts) > 1 else ()
        self._held: dict[str, _Held] = {}
        self._held_bytes = 0
        self._res: Resources | None = None
        self._sock: AsyncSocket | None = None
        self.endpoint = ""
        self._key: str | None = None
        #: Most batches ever in flight (sent, not acknowledged) to one client.
        self.peak_in_flight = 0
        #: Transfers released because their pull was complete.
        self.completed = 0
        self.bad_input = BadInput(log)

    @property
    def held_bytes(self) -> int:
        return self._held_bytes

    @property
    def num_held(self) -> int:
        return len(self._held)

    async def start(self) -> str:
        """Bind the ROUTER and start serving; returns the advertised endpoint."""
        if self._res is not None:
            raise RuntimeError("KvTransferServer already started")
        self._res = res = Resources("kv-transfer-server")
        res.on_close(self._close)
        raw = make_socket(res.zctx, zmq.ROUTER, bind=f"tcp://{self._bind_host}:{self.config.port}",
                          zap_domain=Domain.KV_TRANSFER)
        self._sock = AsyncSocket(raw)
        bound = raw.getsockopt(zmq.LAST_ENDPOINT)
        port = (bound.decode() if isinstance(bound, bytes) else str(bound)).rsplit(":", 1)[1]
        self.endpoint = f"tcp://{self._advertise}:{port}"
        curve = current_curve()
        self._key = curve.public.decode() if curve is not None else None
        res.spawn(self._sock.drain_forever(self._dispatch, "a KV transfer client"),
                  "kv-transfer-serve")
        res.spawn(self._expire_loop(), "kv-transfer-expiry")
        return self.endpoint

    async def close(self) -> None:
        """Stop serving and release every held transfer (``closed``). Idempotent."""
        if self._res is not None:
            await self._res.close()

    def _close(self) -> None:
        for tid in list(self._held):
            self._release(tid, "closed")
        if self._sock is not None:
            self._sock.close()

    # -- offers ----------------------------------------------------------------------------

    def offer(self, blocks: Sequence[bytes], *, num_bytes: int | None = None,
              on_release: OnRelease | None = None) -> Ticket:
        """Hold ``blocks`` for one pull and return its ticket.

        ``num_bytes`` is the memory the transfer holds as the engine counts it (default: the
        payloads' length); ``on_release(reason)`` runs once when it is released.

        Raises:
            TransferFull: the transfers held would exceed ``max_bytes`` (nothing is held).
            RuntimeError: the server is not running.
        """
        if self._res is None or self._res.closed:
            raise RuntimeError("KvTransferServer is not running")
        size = sum(len(b) for b in blocks) if num_bytes is None else num_bytes
        if self._held_bytes + size > self.config.max_bytes:
            self.metrics.refused.inc()
            raise TransferFull(
                f"KV transfer of {size} bytes refused: {self._held_bytes} of "
                f"{self.config.max_bytes} bytes already held for transfers not yet pulled"
            )
        tid = secrets.token_urlsafe(12)
        loop = asyncio.get_running_loop()
        self._held[tid] = _Held(list(blocks), size, on_release, loop.time() + self.config.ttl)
        self._held_bytes += size
        self.metrics.held.inc()
        self.metrics.held_bytes.inc(size)
        return Ticket(transfer_endpoint=self.endpoint, transfer_id=tid, num_blocks=len(blocks),
                      num_bytes=size, transfer_key=self._key, transfer_hosts=self._hosts)

    def _release(self, tid: str, reason: str) -> None:
        held = self._held.pop(tid, None)
        if held is None:
            return
        self._held_bytes -= held.num_bytes
        self.metrics.held.dec()
        self.metrics.held_bytes.dec(held.num_bytes)
        if reason == "expired":
            self.metrics.expired.inc()
            log.info("KV transfer %s expired (%d blocks, %d bytes)", tid, len(held.blocks),
                     held.num_bytes)
        elif reason == "pulled":
            self.completed += 1
        if held.on_release is not None:
            try:
                held.on_release(reason)
            except Exception:
                log.exception("on_release of KV transfer %s failed", tid)

    async def _expire_loop(self) -> None:
        loop = asyncio.get_running_loop()
        period = min(1.0, self.config.ttl / 4)
        while True:
            await asyncio.sleep(period)
            now = loop.time()
            for tid in [t for t, h in self._held.items() if h.deadline <= now]:
                self._release(tid, "expired")

    # -- the protocol ----------------------------------------------------------------------

    def _dispatch(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self.bad_input.note("kv_transfer_frame", "ignoring a KV transfer message of %d "
                                "frames: %.200r", len(frames), frames[:4])
            return
        peer, data = frames
        try:
            msg = decode_client(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.bad_input.note("kv_transfer_frame", "ignoring a malformed KV transfer message "
                                "(%s): %.200r", exc, data)
            return
        held = self._held.get(msg.transfer_id)
        if isinstance(msg, Pull):
            self._on_pull(peer, msg, held)
        elif held is None:
            return  # an Ack or Release after the end: nothing to do
        elif held.peer is not None and held.peer != peer:
            self.bad_input.note("kv_transfer_frame", "ignoring a KV transfer message for "
                                "transfer %s from a client that is not pulling it",
                                msg.transfer_id)
        elif isinstance(msg, Release):
            self._release(msg.transfer_id, "released")
        elif isinstance(msg, Ack):
            self._on_ack(msg, held)

    def _on_pull(self, peer: bytes, msg: Pull, held: _Held | None) -> None:
        tid = msg.transfer_id
        if held is None or (held.peer is not None and held.peer != peer):
            reason = "unknown" if held is None else "busy"
            text = (f"KV transfer {tid} is unknown, already pulled or expired" if held is None
                    else f"KV transfer {tid} is being pulled by another client")
            self._send(peer, Failure(tid, reason, text))
            return
        if held.peer is None:
            held.peer = peer
            held.credit = msg.credit
        held.deadline = asyncio.get_running_loop().time() + self.config.ttl
        self._pump(tid, held)

    def _on_ack(self, msg: Ack, held: _Held) -> None:
        if msg.seq != held.acked or held.acked >= held.sent:
            self.bad_input.note("kv_transfer_frame", "ignoring an out-of-order KV transfer ack "
                                "%d (expected %d)", msg.seq, held.acked)
            return
        held.acked += 1
        held.credit += 1
        held.deadline = asyncio.get_running_loop().time() + self.config.ttl
        if held.next_block >= len(held.blocks) and held.acked == held.sent:
            self._release(msg.transfer_id, "pulled")
            return
        self._pump(msg.transfer_id, held)

    def _pump(self, tid: str, held: _Held) -> None:
        """Send batches while the client has credit and blocks remain."""
        n = self.config.batch_blocks
        blocks = held.blocks
        assert held.peer is not None
        while held.credit > 0 and (held.next_block < len(blocks) or held.sent == 0):
            batch = blocks[held.next_block : held.next_block + n]
            last = held.next_block + n >= len(blocks)
            if not self._send(held.peer, Batch(tid, held.sent, batch, last)):
                self._release(tid, "gone")
                return
            held.next_block += n
            held.sent += 1
            held.credit -= 1
            self.peak_in_flight = max(self.peak_in_flight, held.sent - held.acked)
            self.metrics.sent_bytes.inc(sum(len(b) for b in batch))

    def _send(self, peer: bytes, msg: Batch | Failure) -> bool:
        sock = self._sock
        if sock is None or sock.closed:
            return False
        # Credit bounds what one client has queued far below the HWM: FULL means it is stuck.
        return sock.try_send([peer, encode(msg)]) == SendResult.SENT
