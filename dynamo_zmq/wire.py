"""Request-plane messages: typed msgspec Structs encoded as plain MessagePack.

Every ZMQ message is two frames, ``[kind][payload]`` (the ROUTER side adds the peer identity in
front). ``kind`` is one byte, so a receiver dispatches before decoding; ``payload`` is the
MessagePack encoding of the Struct for that kind (array-like, so field order is the schema: new
fields go last, with defaults).

Client (DEALER) -> server (ROUTER): REQUEST, STOP, KILL, CREDIT, PING, DESCRIBE.
Server -> client: DATA, END, ERROR, PONG, INFO, NOTICE, and BATCH (several streams' DATA, END and
ERROR frames to one client in one message).

A stream is the DATA frames of one request id, numbered ``seq`` 0, 1, 2, ...; each carries a list
of items (items that became ready together are coalesced into one frame). It ends with exactly one
terminal, END or ERROR, whose ``seq`` is the number of DATA frames sent before it, so a receiver
can tell a lost or reordered frame from a clean end.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "CLIENT_KINDS",
    "PROTOCOL_VERSION",
    "SERVER_KINDS",
    "Batch",
    "Control",
    "Credit",
    "Data",
    "Describe",
    "Description",
    "End",
    "EndpointInfo",
    "Error",
    "Kind",
    "Notice",
    "Ping",
    "Pong",
    "RawBatch",
    "RawData",
    "Request",
    "decode_item",
    "encode",
    "encode_item",
]


#: Bumped when the request-plane wire format changes incompatibly; peers of another version are
#: never routed to.
PROTOCOL_VERSION = 2


class Kind:
    """One-byte frame kinds."""

    REQUEST = b"R"
    STOP = b"S"
    KILL = b"K"
    CREDIT = b"C"
    PING = b"P"
    DESCRIBE = b"D"

    DATA = b"d"
    END = b"e"
    ERROR = b"x"
    PONG = b"p"
    INFO = b"i"
    NOTICE = b"n"
    BATCH = b"b"


_STRUCT = {"array_like": True, "omit_defaults": False, "gc": False}


class Request(msgspec.Struct, **_STRUCT):
    """Open a stream: call ``endpoint`` (``namespace.component.endpoint``) with ``payload``."""

    request_id: int
    endpoint: str
    context_id: str
    #: The caller's request object, itself plain MessagePack.
    payload: msgspec.Raw
    #: How many items the server may send before it needs more CREDIT.
    window: int = 1024
    #: Seconds the server may spend on this request (None: no deadline).
    timeout: float | None = None
    #: The caller's W3C trace context (``traceparent``, ``tracestate``) with tracing on; None:
    #: no parent (the server's span, if any, starts a trace).
    trace: dict[str, str] | None = None


class Control(msgspec.Struct, **_STRUCT):
    """STOP (finish gracefully) or KILL (abandon now) the stream ``request_id``."""

    request_id: int


class Credit(msgspec.Struct, **_STRUCT):
    """The client consumed ``items`` more items of ``request_id``: the server may send that many."""

    request_id: int
    items: int


class Ping(msgspec.Struct, **_STRUCT):
    nonce: int


class Describe(msgspec.Struct, **_STRUCT):
    """Ask the server for its full ``Description``."""

    nonce: int = 0


class Data(msgspec.Struct, **_STRUCT):
    """Items of ``request_id``, frame ``seq``. Each item is one MessagePack value: a sender may
    put the objects themselves in ``items`` (they encode to the same bytes)."""

    request_id: int
    seq: int
    items: list[msgspec.Raw]


class End(msgspec.Struct, **_STRUCT):
    request_id: int
    seq: int


class Error(msgspec.Struct, **_STRUCT):
    """Terminal error of ``request_id``; request id 0 reports a frame that named no stream."""

    request_id: int
    seq: int
    kind: str
    message: str


class Batch(msgspec.Struct, **_STRUCT):
    """Several streams' frames to one client, sent in one message (same meaning as sending each
    DATA, then each END, then each ERROR)."""

    data: list[Data]
    ends: list[End] = msgspec.field(default_factory=list)
    errors: list[Error] = msgspec.field(default_factory=list)


class RawData(msgspec.Struct, **_STRUCT):
    """DATA as a receiver reads it: the same bytes, its items left as one raw MessagePack array,
    which the stream's own decoder turns into its items in one call."""

    request_id: int
    seq: int
    items: msgspec.Raw


class RawBatch(msgspec.Struct, **_STRUCT):
    """BATCH as a receiver reads it (``RawData`` frames)."""

    data: list[RawData]
    ends: list[End] = msgspec.field(default_factory=list)
    errors: list[Error] = msgspec.field(default_factory=list)


class Pong(msgspec.Struct, **_STRUCT):
    nonce: int
    instance_id: int
    #: Description revision: a client refetches the description when it changes.
    rev: int
    draining: bool = False
    inflight: int = 0


class Notice(msgspec.Struct, **_STRUCT):
    """Unsolicited state change pushed to connected clients (draining, new revision)."""

    instance_id: int
    rev: int
    draining: bool


class EndpointInfo(msgspec.Struct, **_STRUCT):
    namespace: str
    component: str
    name: str
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def path(self) -> str:
        return f"{self.namespace}.{self.component}.{self.name}"


class Description(msgspec.Struct, **_STRUCT):
    """Everything a peer needs to know about a serving process (answer to DESCRIBE)."""

    instance_id: int
    protocol_version: int
    rev: int
    started_at: float
    hostname: str
    pid: int
    endpoints: list[EndpointInfo]
    draining: bool = False
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    #: The addresses its request plane is advertised at. Its other endpoints (KV events, load)
    #: advertised at one of them are reached at the one a caller dialed (``endpoint_via``).
    hosts: list[str] = msgspec.field(default_factory=list)


CLIENT_KINDS: dict[bytes, type[msgspec.Struct]] = {
    Kind.REQUEST: Request,
    Kind.STOP: Control,
    Kind.KILL: Control,
    Kind.CREDIT: Credit,
    Kind.PING: Ping,
    Kind.DESCRIBE: Describe,
}

SERVER_KINDS: dict[bytes, type[msgspec.Struct]] = {
    Kind.DATA: Data,
    Kind.END: End,
    Kind.ERROR: Error,
    Kind.PONG: Pong,
    Kind.INFO: Description,
    Kind.NOTICE: Notice,
    Kind.BATCH: Batch,
}


def _enc_hook(obj: Any) -> Any:
    # pydantic models (Dynamo's @dynamo_endpoint request/response types) and anything else that
    # knows how to dump itself.
    dump = getattr(obj, "model_dump", None)
    if dump is not None:
        return dump(mode="json")
    raise NotImplementedError(f"cannot encode {type(obj).__name__} to MessagePack")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_item_decoder = msgspec.msgpack.Decoder()

encode = _encoder.encode


def encode_item(obj: Any) -> msgspec.Raw:
    """Encode a user object (request or response item) as a raw MessagePack value."""
    return msgspec.Raw(_encoder.encode(obj))


def decode_item(raw: bytes | msgspec.Raw) -> Any:
    """Decode a user object sent with ``encode_item``."""
    return _item_decoder.decode(raw)
