"""``KvTransferClient``: a decode worker pulls the KV blocks a prefill worker holds for it.

One DEALER per pull, connected to the ticket's endpoint (a CURVE client of the ticket's key
when auth is on); when the ticket names several addresses of the server (a multi-homed prefill
worker), at the first one on a network this host is attached to. It grants the server
``credit`` batches and acknowledges each batch once the consumer has taken it, so a slow
consumer slows the server down instead of piling up memory. Every way a pull can break ends in
a typed error within the timeout: never a hang.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import msgspec
import zmq

from .. import errors
from ..context import Context
from ..discovery import local_networks, pick_ip
from ..resources import cancel_and_wait, process_zmq_context
from ..transport import AsyncSocket, BadInput, make_socket
from ._config import KvTransferConfig
from ._errors import TransferFailed, TransferNotFound
from ._messages import Ack, Batch, Pull, Release, Ticket, decode_server, encode
from ._metrics import KvTransferMetrics

__all__ = ["KvTransferClient"]

log = logging.getLogger(__name__)


class KvTransferClient:
    """Pulls transfers (see the module docstring).

    Args:
        config: credit and timeout.
        metrics: where to count (default: metrics of its own).
    """

    def __init__(self, config: KvTransferConfig | None = None,
                 metrics: KvTransferMetrics | None = None) -> None:
        self.config = config or KvTransferConfig()
        self.metrics = metrics or KvTransferMetrics()
        self.bad_input = BadInput(log)

    async def pull(self, ticket: Ticket, ctx: Context | None = None, *,
                   deadline: float | None = None,
                   credit: int | None = None) -> AsyncIterator[list[bytes]]:
        """The transfer's blocks, one batch (a list of block payloads) at a time.

        A batch is acknowledged when the next one is asked for, so the server never has more
        than ``credit`` (default: the config's) batches ahead of the consumer. Closing the
        iterator early releases the transfer on the server.

        Args:
            ticket: the handoff ``KvTransferServer.offer`` returned.
            ctx: stopping it ends the pull with ``Cancelled`` (the server is told to release).
            deadline: ``time.monotonic()`` by which the whole pull must be over.

        Raises:
            TransferNotFound: the server does not know the transfer (pulled or expired).
            TransferFailed: the server vanished, stopped answering, refused us, or sent garbage.
            Cancelled: ``ctx`` was stopped.
        """
        t = ticket
        grant = credit or self.config.credit
        try:
            raw = make_socket(
                process_zmq_context(), zmq.DEALER, connect=reachable_endpoint(t),
                server_key=t.transfer_key.encode() if t.transfer_key else None,
            )
        except errors.CannotConnect as exc:  # CURVE: no key, or not authorized
            self.metrics.failed.inc()
            raise TransferFailed(f"KV transfer {t.transfer_id}: {exc.message}") from exc
        except zmq.ZMQError as exc:
            self.metrics.failed.inc()
            raise TransferFailed(f"KV transfer {t.transfer_id}: bad endpoint "
                                 f"{t.transfer_endpoint!r}: {exc}") from exc
        sock = AsyncSocket(raw)
        loop = asyncio.get_running_loop()
        stop: asyncio.Future[None] = loop.create_future()

        def on_stop(_killed: bool) -> None:
            if not stop.done():
                stop.set_result(None)

        remove = ctx.add_listener(on_stop) if ctx is not None else None
        started = time.monotonic()
        done = False
        try:
            sock.try_send([encode(Pull(t.transfer_id, grant))])
            seq = 0
            while True:
                batch = await self._next(sock, t, seq, stop, deadline)
                self.metrics.received_bytes.inc(sum(len(b) for b in batch.blocks))
                yield batch.blocks
                if stop.done():  # stopped while the consumer had the batch: release, no ack
                    raise errors.Cancelled(f"KV transfer {t.transfer_id} cancelled")
                sock.try_send([encode(Ack(t.transfer_id, seq))])
                seq += 1
                if batch.last:
                    done = True
                    self.metrics.seconds.observe(time.monotonic() - started)
                    return
        except errors.DynamoError as exc:
            if not isinstance(exc, errors.Cancelled):
                self.metrics.failed.inc()
            raise
        finally:
            if remove is not None:
                remove()
            if not done and not sock.closed:
                sock.try_send([encode(Release(t.transfer_id))])
            sock.close(linger_ms=0 if done else 100)

    async def _next(self, sock: AsyncSocket, t: Ticket, seq: int, stop: asyncio.Future[None],
                    deadline: float | None) -> Batch:
        """The next batch, which must be number ``seq`` of the transfer."""
        while True:
            frames = sock.recv_nowait()
            if frames is not None:
                return self._check(frames, t, seq)
            wait = self.config.timeout
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
            if stop.done():
                raise errors.Cancelled(f"KV transfer {t.transfer_id} cancelled")
            if wait <= 0:
                raise TransferFailed(f"KV transfer {t.transfer_id}: the pull's deadline passed")
            readable = asyncio.ensure_future(sock.wait_readable())
            try:
                await asyncio.wait({readable, stop}, timeout=wait,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                await cancel_and_wait([readable])
            if stop.done():
                raise errors.Cancelled(f"KV transfer {t.transfer_id} cancelled")
            if not readable.done() or readable.cancelled():
                raise TransferFailed(
                    f"KV transfer {t.transfer_id}: no answer from {t.transfer_endpoint} within "
                    f"{wait:.3g} s (batch {seq})"
                )

    def _check(self, frames: list[bytes], t: Ticket, seq: int) -> Batch:
        try:
            if len(frames) != 1:
                raise ValueError(f"{len(frames)} frames")
            msg = decode_server(frames[0])
        except (ValueError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.bad_input.note("kv_transfer_frame", "malformed KV transfer message: %s", exc)
            raise TransferFailed(f"KV transfer {t.transfer_id}: malformed message "
                                 f"from {t.transfer_endpoint}: {exc}") from exc
        if msg.transfer_id != t.transfer_id:
            raise TransferFailed(f"KV transfer {t.transfer_id}: a message for another transfer")
        if not isinstance(msg, Batch):
            if msg.reason == "unknown":
                raise TransferNotFound(msg.message)
            raise TransferFailed(msg.message)
        if msg.seq != seq:
            raise TransferFailed(f"KV transfer {t.transfer_id}: batch {msg.seq}, expected {seq}")
        return msg


def reachable_endpoint(ticket: Ticket) -> str:
    """The ticket's endpoint at the first of its server's addresses that is on one of this
    host's networks (the advertised one if it is, or if none is)."""
    endpoint = ticket.transfer_endpoint
    if not ticket.transfer_hosts:
        return endpoint
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    best = pick_ip([host, *ticket.transfer_hosts], local_networks(()))
    return f"tcp://{best}:{port}" if best else endpoint
