"""What a client sends the server, decoded: one msgspec decoder per frame kind, and the request
id salvaged from a frame that does not decode (so its error still names the request).
"""

from __future__ import annotations

import msgspec

from ..wire import Control, Credit, Describe, Kind, Ping, Request

__all__ = ["DECODERS", "FromClient", "request_id_of"]

FromClient = Request | Control | Credit | Ping | Describe
"""What a client sends; each frame kind decodes to one of these types (STOP and KILL to
``Control``)."""

DECODERS: dict[bytes, msgspec.msgpack.Decoder[FromClient]] = {
    Kind.REQUEST: msgspec.msgpack.Decoder(Request),
    Kind.STOP: msgspec.msgpack.Decoder(Control),
    Kind.KILL: msgspec.msgpack.Decoder(Control),
    Kind.CREDIT: msgspec.msgpack.Decoder(Credit),
    Kind.PING: msgspec.msgpack.Decoder(Ping),
    Kind.DESCRIBE: msgspec.msgpack.Decoder(Describe),
}

#: Splits an array-like payload into its elements without decoding them (strings of invalid
#: UTF-8 included), so a request whose other fields are bad still has its id echoed.
_elements = msgspec.msgpack.Decoder(list[msgspec.Raw])


def request_id_of(payload: bytes) -> int:
    """Best effort: the first element of an array-like payload, if it is a positive int."""
    try:
        value = msgspec.msgpack.decode(_elements.decode(payload)[0])
    except Exception:
        return 0
    # type() rather than isinstance(): a bool is not an id (and would encode as true, not an int).
    return value if type(value) is int and value > 0 else 0
