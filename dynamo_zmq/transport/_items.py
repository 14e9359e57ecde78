"""What a response stream's items are made of: each DATA frame's items arrive as one
MessagePack array and are decoded in one call by the decoder the request was sent with:
``response_items`` (Dynamo's annotated ``Response``, each decoded on ``data()``),
``plain_items`` (plain values) or a typed msgspec decoder (``item_decoder(T)``).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from .. import errors
from ..wire import decode_item

__all__ = ["ItemDecoder", "Response", "decode_items", "item_decoder", "plain_items",
           "response_items"]

T = TypeVar("T")

ItemDecoder = Callable[[msgspec.Raw], list[T]]
"""Turns one DATA frame's items (a MessagePack array) into what the stream yields."""

_typed_decoders: dict[Any, Callable[[msgspec.Raw], Any]] = {}
_raw_items = msgspec.msgpack.Decoder(list[msgspec.Raw]).decode

plain_items: ItemDecoder[Any] = msgspec.msgpack.Decoder(list[Any]).decode
"""Items as plain Python values (what ``decode_item`` makes of each)."""


def item_decoder(item_type: type[T]) -> ItemDecoder[T]:
    """A decoder validating items into ``item_type`` (built once per type)."""
    decode = _typed_decoders.get(item_type)
    if decode is None:
        # ``list[item_type]`` built at run time (a type variable's value is no static type)
        list_type = types.GenericAlias(list, (item_type,))
        decode = _typed_decoders[item_type] = msgspec.msgpack.Decoder(list_type).decode
    return decode


def response_items(raw: msgspec.Raw) -> list[Response]:
    """Items as ``Response`` objects, each decoded on first ``data()`` (Dynamo's form)."""
    return [Response(item) for item in _raw_items(raw)]


def decode_items(
    decode: ItemDecoder[T], raw: msgspec.Raw
) -> tuple[list[T], errors.DynamoError | None]:
    """The items of one frame, and the error that ends the stream if one does not decode: the
    items before it are still delivered (decoded one by one to find it)."""
    try:
        return decode(raw), None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        pass
    good: list[T] = []
    try:
        for item in _raw_items(raw):
            good.extend(decode(msgspec.Raw(b"\x91" + bytes(item))))  # a one-item array
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        return good, errors.Unknown(f"undecodable response item: {exc}")
    return good, errors.Unknown("undecodable response items")


class Response:
    """One streamed item; ``data()`` decodes it on first use (Dynamo's annotated response)."""

    __slots__ = ("_raw", "_value")

    _UNSET: Any = object()

    def __init__(self, raw: msgspec.Raw) -> None:
        self._raw = raw
        self._value = Response._UNSET

    def data(self) -> Any:
        if self._value is Response._UNSET:
            self._value = decode_item(self._raw)
        return self._value

    def raw(self) -> bytes:
        return bytes(self._raw)

    def __repr__(self) -> str:
        return f"Response({self.data()!r})"
