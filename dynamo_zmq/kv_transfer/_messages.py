"""The KV-transfer wire messages (MessagePack, one frame each) and the handoff ticket.

A decode worker's DEALER talks to a prefill worker's ROUTER:

    client -> server   Pull(transfer_id, credit)   start; ``credit`` batches may be in flight
                       Ack(transfer_id, seq)       batch ``seq`` consumed: one more credit
                       Release(transfer_id)        stop; the server drops the transfer
    server -> client   Batch(transfer_id, seq, blocks, last)
                       Failure(transfer_id, reason, message)

Each message is a msgspec array tagged with its type name, so garbage fails to decode (a typed
error) instead of being half-understood.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

__all__ = [
    "Ack",
    "Batch",
    "ClientMessage",
    "Failure",
    "Pull",
    "Release",
    "ServerMessage",
    "Ticket",
    "decode_client",
    "decode_server",
    "encode",
]

_MSG = {"tag": True, "array_like": True, "forbid_unknown_fields": True}
_Count = Annotated[int, msgspec.Meta(ge=0)]
_Id = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class Pull(msgspec.Struct, **_MSG):
    """Start sending ``transfer_id``: at most ``credit`` batches unacknowledged at a time."""

    transfer_id: _Id
    credit: Annotated[int, msgspec.Meta(ge=1, le=1024)]


class Ack(msgspec.Struct, **_MSG):
    """Batch ``seq`` was consumed: the server may send one more."""

    transfer_id: _Id
    seq: _Count


class Release(msgspec.Struct, **_MSG):
    """The client gives up the transfer (cancelled or failed): the server frees it now."""

    transfer_id: _Id


class Batch(msgspec.Struct, **_MSG):
    """Blocks ``seq * batch_blocks ...`` of a transfer; ``last`` on the final batch."""

    transfer_id: _Id
    seq: _Count
    blocks: list[bytes]
    last: bool


class Failure(msgspec.Struct, **_MSG):
    """The server cannot serve ``transfer_id``: ``reason`` is ``unknown`` (never offered, already
    pulled or expired) or ``busy`` (another client is pulling it)."""

    transfer_id: str
    reason: str
    message: str


ClientMessage = Pull | Ack | Release
ServerMessage = Batch | Failure

_encoder = msgspec.msgpack.Encoder()
_client = msgspec.msgpack.Decoder(ClientMessage)
_server = msgspec.msgpack.Decoder(ServerMessage)


def encode(msg: Pull | Ack | Release | Batch | Failure) -> bytes:
    return _encoder.encode(msg)


def decode_client(data: bytes) -> Pull | Ack | Release:
    """A client's message. Raises ``msgspec.DecodeError`` (or ``ValidationError``) on garbage."""
    try:
        msg: Pull | Ack | Release = _client.decode(data)
    except UnicodeDecodeError as exc:  # msgspec lets a non-UTF-8 tag through as this
        raise msgspec.DecodeError(str(exc)) from exc
    return msg


def decode_server(data: bytes) -> Batch | Failure:
    """A server's message. Raises ``msgspec.DecodeError`` (or ``ValidationError``) on garbage."""
    try:
        msg: Batch | Failure = _server.decode(data)
    except UnicodeDecodeError as exc:  # msgspec lets a non-UTF-8 tag through as this
        raise msgspec.DecodeError(str(exc)) from exc
    return msg


class Ticket(msgspec.Struct, frozen=True, kw_only=True, tag="transfer", tag_field="type",
             omit_defaults=True):
    """A prefill's KV held by a ``KvTransferServer`` for one pull: the handoff a prefill worker
    returns and a decode worker pulls with (``dynamo_zmq.llm.PrefillRemotely.handoff``)."""

    #: The prefill worker's transfer ROUTER, e.g. ``tcp://10.0.0.5:40123``.
    transfer_endpoint: str
    transfer_id: _Id
    num_blocks: _Count
    #: The bytes the engine holds for the transfer (its KV, as the engine counts it).
    num_bytes: _Count
    #: The server's CURVE public key (Z85) when the prefill worker runs with auth keys.
    transfer_key: str | None = None
    #: Every address the server is reached at, when it binds several (a multi-homed prefill
    #: worker): a decode worker dials the first on a network it is attached to.
    transfer_hosts: tuple[str, ...] = ()
