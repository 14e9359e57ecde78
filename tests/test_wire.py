"""Every wire Struct round-trips, and its bytes are plain MessagePack (checked with ``msgpack``).

Each strategy below yields a Struct together with the array a MessagePack reader must see:
the fields in declaration order, nested Structs as arrays, raw user items as their values.
"""

from __future__ import annotations

from typing import Any

import msgpack
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_zmq import wire
from dynamo_zmq.transport import plain_items
from dynamo_zmq.wire import (
    Batch,
    Control,
    Credit,
    Data,
    Describe,
    Description,
    End,
    EndpointInfo,
    Error,
    Notice,
    Ping,
    Pong,
    RawBatch,
    RawData,
    Request,
    decode_item,
    encode,
    encode_item,
)

SETTINGS = settings(max_examples=150, deadline=None)

# MessagePack carries ints from -2**63 to 2**64 - 1.
ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
floats = st.floats(allow_nan=False)  # NaN != NaN would defeat the equality checks
texts = st.text(max_size=40)

# User items: what a handler may yield or a caller may send (JSON-like plus bytes).
scalars = st.none() | st.booleans() | ints | floats | texts | st.binary(max_size=40)
items = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(texts, children, max_size=5),
    max_leaves=25,
)


def reference_unpack(raw: bytes) -> Any:
    return msgpack.unpackb(raw, raw=False)


@st.composite
def endpoint_infos(draw: st.DrawFn) -> tuple[EndpointInfo, list[Any]]:
    ns, comp, name = draw(texts), draw(texts), draw(texts)
    meta = draw(st.dictionaries(texts, items, max_size=4))
    return EndpointInfo(ns, comp, name, meta), [ns, comp, name, meta]


@st.composite
def requests(draw: st.DrawFn) -> tuple[Request, list[Any]]:
    rid, endpoint, ctx_id = draw(ints), draw(texts), draw(texts)
    payload = draw(items)
    window = draw(ints)
    timeout = draw(st.none() | floats)
    trace = draw(st.none() | st.dictionaries(texts, texts, max_size=2))  # W3C trace context
    msg = Request(rid, endpoint, ctx_id, encode_item(payload), window, timeout, trace)
    return msg, [rid, endpoint, ctx_id, payload, window, timeout, trace]


@st.composite
def datas(draw: st.DrawFn) -> tuple[Data, list[Any]]:
    rid, seq = draw(ints), draw(ints)
    values = draw(st.lists(items, max_size=8))
    return Data(rid, seq, [encode_item(v) for v in values]), [rid, seq, values]


@st.composite
def batches(draw: st.DrawFn) -> tuple[Batch, list[Any]]:
    data = draw(st.lists(datas(), max_size=3))
    ends = draw(st.lists(st.tuples(ints, ints), max_size=3))
    errs = draw(st.lists(st.tuples(ints, ints, texts, texts), max_size=3))
    msg = Batch([d for d, _ in data], [End(*e) for e in ends], [Error(*e) for e in errs])
    return msg, [[arr for _, arr in data], [list(e) for e in ends], [list(e) for e in errs]]


@st.composite
def raw_datas(draw: st.DrawFn) -> tuple[RawData, list[Any]]:
    rid, seq = draw(ints), draw(ints)
    values = draw(st.lists(items, max_size=8))
    return RawData(rid, seq, encode_item(values)), [rid, seq, values]


@st.composite
def raw_batches(draw: st.DrawFn) -> tuple[RawBatch, list[Any]]:
    data = draw(st.lists(raw_datas(), max_size=3))
    ends = draw(st.lists(st.tuples(ints, ints), max_size=3))
    errs = draw(st.lists(st.tuples(ints, ints, texts, texts), max_size=3))
    msg = RawBatch([d for d, _ in data], [End(*e) for e in ends], [Error(*e) for e in errs])
    return msg, [[arr for _, arr in data], [list(e) for e in ends], [list(e) for e in errs]]


@st.composite
def descriptions(draw: st.DrawFn) -> tuple[Description, list[Any]]:
    eps = draw(st.lists(endpoint_infos(), max_size=4))
    fields = [
        draw(ints),  # instance_id
        draw(ints),  # protocol_version
        draw(ints),  # rev
        draw(floats),  # started_at
        draw(texts),  # hostname
        draw(ints),  # pid
    ]
    draining = draw(st.booleans())
    meta = draw(st.dictionaries(texts, items, max_size=4))
    hosts = draw(st.lists(texts, max_size=3))
    msg = Description(*fields, [e for e, _ in eps], draining, meta, hosts)
    return msg, [*fields, [arr for _, arr in eps], draining, meta, hosts]


def _plain(cls: type[msgspec.Struct], *field_strategies: st.SearchStrategy[Any]):
    """Structs whose fields are all plain values: the expected array is the field list."""
    return st.tuples(*field_strategies).map(lambda values: (cls(*values), list(values)))


structs = st.one_of(
    requests(),
    _plain(Control, ints),
    _plain(Credit, ints, ints),
    _plain(Ping, ints),
    _plain(Describe, ints),
    datas(),
    batches(),
    raw_datas(),
    raw_batches(),
    _plain(End, ints, ints),
    _plain(Error, ints, ints, texts, texts),
    _plain(Pong, ints, ints, ints, st.booleans(), ints),
    _plain(Notice, ints, ints, st.booleans()),
    endpoint_infos(),
    descriptions(),
)


def comparable(value: Any) -> Any:
    """A Struct as nested plain values, raw items decoded (two encoders may spell one value
    differently)."""
    if isinstance(value, msgspec.Raw):
        return ("raw", decode_item(value))
    if isinstance(value, msgspec.Struct):
        return (
            type(value).__name__,
            [comparable(getattr(value, f)) for f in value.__struct_fields__],
        )
    if isinstance(value, list):
        return [comparable(v) for v in value]
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items()}
    return value


@SETTINGS
@given(pair=structs)
def test_struct_round_trips_through_msgspec(pair: tuple[msgspec.Struct, list[Any]]) -> None:
    msg, _ = pair
    decoded = msgspec.msgpack.decode(encode(msg), type=type(msg))
    assert comparable(decoded) == comparable(msg)


@SETTINGS
@given(pair=structs)
def test_struct_bytes_are_plain_msgpack(pair: tuple[msgspec.Struct, list[Any]]) -> None:
    msg, expected = pair
    raw = encode(msg)
    # A reference MessagePack reader sees the fields as an array, in schema order.
    assert reference_unpack(raw) == expected
    # And what a reference writer produces from that array is accepted back, unchanged.
    again = msgspec.msgpack.decode(msgpack.packb(expected), type=type(msg))
    assert comparable(again) == comparable(msg)


@SETTINGS
@given(value=items)
def test_user_items_are_plain_msgpack(value: Any) -> None:
    raw = encode_item(value)
    assert isinstance(raw, msgspec.Raw)
    assert decode_item(raw) == value
    assert reference_unpack(bytes(raw)) == value
    assert decode_item(msgpack.packb(value)) == value


@SETTINGS
@given(pair=requests(), extra=st.lists(items, max_size=3))
def test_request_schema_evolves_at_the_end(
    pair: tuple[Request, list[Any]], extra: list[Any]
) -> None:
    msg, fields = pair
    # An older sender omits trailing fields that have defaults ...
    old = msgspec.msgpack.decode(msgpack.packb(fields[:4]), type=Request)
    assert comparable(old) == comparable(
        Request(*[msg.request_id, msg.endpoint, msg.context_id, msg.payload])
    )
    assert (old.window, old.timeout, old.trace) == (1024, None, None)
    # ... and a newer one may append fields this version does not know.
    new = msgspec.msgpack.decode(msgpack.packb([*fields, *extra]), type=Request)
    assert comparable(new) == comparable(msg)


@SETTINGS
@given(rid=ints, seq=ints, values=st.lists(items, max_size=8))
def test_data_with_objects_is_the_same_bytes_and_reads_back_as_raw_data(
    rid: int, seq: int, values: list[Any]
) -> None:
    """The server encodes a frame's items as they are, in one call; a reader sees the same
    bytes as item-by-item encoding, and ``RawData`` keeps the items as one array."""
    whole = encode(Data(rid, seq, values))
    assert whole == encode(Data(rid, seq, [encode_item(v) for v in values]))
    view = msgspec.msgpack.decode(whole, type=RawData)
    assert (view.request_id, view.seq) == (rid, seq)
    assert plain_items(view.items) == values == [decode_item(r) for r in
                                                 msgspec.msgpack.decode(whole, type=Data).items]


def test_every_wire_struct_is_covered_here() -> None:
    exported = {
        obj
        for name in wire.__all__
        if isinstance(obj := getattr(wire, name), type) and issubclass(obj, msgspec.Struct)
    }
    covered = {
        Request, Control, Credit, Ping, Describe, Data, Batch, RawData, RawBatch, End, Error,
        Pong, Notice, EndpointInfo, Description,
    }  # fmt: skip
    assert exported == covered, "add a strategy for the new Struct to `structs`"


def test_kinds_are_distinct_single_bytes() -> None:
    kinds = [*wire.CLIENT_KINDS, *wire.SERVER_KINDS]
    assert all(isinstance(k, bytes) and len(k) == 1 for k in kinds)
    assert len(set(kinds)) == len(kinds)
    assert wire.Kind.ERROR == b"x"


@pytest.mark.parametrize(
    "cls", sorted({*wire.CLIENT_KINDS.values(), *wire.SERVER_KINDS.values()}, key=str)
)
def test_wire_structs_are_compact_arrays(cls: type[msgspec.Struct]) -> None:
    config = cls.__struct_config__
    assert config.array_like and not config.omit_defaults
