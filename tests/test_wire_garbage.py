"""A real serving process attacked through a bare DEALER: it answers garbage, it never falls over.

Every check ends with a *barrier*: a PING whose PONG comes back after the answers to everything
sent before it (one connection is ordered, and the server answers malformed frames at once). So
"the server said nothing" is an assertion, not a sleep, and a missing answer fails the poll
instead of hanging.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_zmq.transport.server import MAX_REQUEST_BYTES
from dynamo_zmq.wire import (
    CLIENT_KINDS,
    Batch,
    Control,
    Credit,
    Data,
    Description,
    End,
    Error,
    Kind,
    Ping,
    Pong,
    Request,
    decode_item,
    encode,
    encode_item,
)
from tests.conftest import app_args
from tests.support.procs import Proc

SETTINGS = settings(max_examples=150, deadline=None)
RECV_TIMEOUT_MS = 5000

_error = msgspec.msgpack.Decoder(Error)
_pong = msgspec.msgpack.Decoder(Pong)
_data = msgspec.msgpack.Decoder(Data)
_end = msgspec.msgpack.Decoder(End)
_batch = msgspec.msgpack.Decoder(Batch)
_info = msgspec.msgpack.Decoder(Description)

ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
values = st.recursive(
    st.none() | st.booleans() | ints | st.floats() | st.text(max_size=10)
    | st.binary(max_size=10),
    lambda kids: st.lists(kids, max_size=4)
    | st.dictionaries(st.text(max_size=5), kids, max_size=4),
    max_leaves=12,
)
# Payloads: raw noise, arbitrary MessagePack, and arrays shaped almost like a real message.
payloads = st.one_of(
    st.binary(max_size=64),
    values.map(msgspec.msgpack.encode),
    st.lists(values, min_size=1, max_size=7).map(msgspec.msgpack.encode),
)
kinds = st.sampled_from([*CLIENT_KINDS, b"d", b"x", b""]) | st.binary(min_size=1, max_size=3)


class RawPeer:
    """A bare DEALER speaking the wire protocol by hand, with bounded waits."""

    _nonces = itertools.count(0x5EED_0000_0000)

    def __init__(self, address: str) -> None:
        self.zctx = zmq.Context()
        self.sock = self.zctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(address)
        self._unpacked: collections.deque[list[bytes]] = collections.deque()

    def close(self) -> None:
        self.sock.close(linger=0)
        self.zctx.term()

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self) -> list[bytes]:
        """The next frame; a BATCH is unpacked into the DATA/END/ERROR frames it stands for."""
        if self._unpacked:
            return self._unpacked.popleft()
        if not self.sock.poll(RECV_TIMEOUT_MS):
            raise AssertionError(f"no answer within {RECV_TIMEOUT_MS} ms")
        frames = self.sock.recv_multipart()
        if frames[0] != Kind.BATCH:
            return frames
        batch = _batch.decode(frames[1])
        self._unpacked.extend([Kind.DATA, encode(d)] for d in batch.data)
        self._unpacked.extend([Kind.END, encode(e)] for e in batch.ends)
        self._unpacked.extend([Kind.ERROR, encode(e)] for e in batch.errors)
        return self._unpacked.popleft()

    def barrier(self) -> list[list[bytes]]:
        """Everything the server sent before answering a fresh PING (NOTICEs left out)."""
        nonce = next(self._nonces)
        self.send(Kind.PING, encode(Ping(nonce)))
        seen = []
        while True:
            frames = self.recv()
            if frames[0] == Kind.PONG and _pong.decode(frames[1]).nonce == nonce:
                return seen
            if frames[0] != Kind.NOTICE:
                seen.append(frames)

    def stream(
        self, rid: int, endpoint: str, request: Any, window: int = 1024, **kw: Any
    ) -> list[Any]:
        """One valid request read to its END; checks the sequence numbers on the way."""
        self.send(
            Kind.REQUEST, encode(Request(rid, endpoint, "ctx", encode_item(request), window, **kw))
        )
        got: list[Any] = []
        frames_seen = 0
        while True:
            kind, body = self.recv()
            if kind == Kind.DATA:
                msg = _data.decode(body)
                assert (msg.request_id, msg.seq) == (rid, frames_seen)
                frames_seen += 1
                got += [decode_item(x) for x in msg.items]
            elif kind == Kind.END:
                end = _end.decode(body)
                assert (end.request_id, end.seq) == (rid, frames_seen)
                return got
            else:
                raise AssertionError(f"unexpected {kind!r} frame in stream {rid}: {body!r}")


class Target:
    def __init__(self, proc: Proc, namespace: str) -> None:
        self.proc = proc
        self.namespace = namespace
        self.count = f"{namespace}.backend.count"
        self._rids = itertools.count(1)

    def rid(self) -> int:
        return next(self._rids)

    def assert_healthy(self, raw: RawPeer) -> None:
        """Still running, never hit an internal error dispatching a frame, and still streams."""
        assert self.proc.popen.poll() is None, self.proc.logs()
        assert raw.stream(self.rid(), self.count, {"n": 3}) == [
            {"i": i, "instance": self.proc.instance_id} for i in range(3)
        ]
        log = Path(self.proc.log.name).read_text(errors="replace")
        assert "error dispatching frame" not in log, log[-3000:]


@pytest.fixture
def target(namespace: str, spawn) -> Target:
    return Target(spawn(*app_args(namespace, "--discovery", "static")), namespace)


@pytest.fixture
def raw(target: Target) -> Iterator[RawPeer]:
    peer = RawPeer(target.proc.address)
    yield peer
    peer.close()


def assert_invalid(frames: list[bytes], request_ids: tuple[int, ...]) -> Error:
    """``frames`` is a typed InvalidArgument ERROR for one of ``request_ids``."""
    assert frames[0] == Kind.ERROR, frames
    err = _error.decode(frames[1])
    assert err.kind == "InvalidArgument", err
    assert err.request_id in request_ids, err
    assert err.seq == 0
    return err


def _request_id_hint(payload: bytes) -> int:
    """The id a reader can see in a bad payload: a positive int first in an array, else 0
    (the array's other elements are not decoded: a string of invalid UTF-8 there still lets
    the id be seen)."""
    try:
        value = msgspec.msgpack.decode(msgspec.msgpack.decode(payload, type=list[msgspec.Raw])[0])
    except Exception:
        return 0
    return value if type(value) is int and value > 0 else 0


def expected_answer(frames: list[bytes]) -> tuple[str, Any]:
    """What the protocol says a server answers to one message from a peer with no open streams."""
    if len(frames) != 2 or frames[0] not in CLIENT_KINDS:
        return "error", (0,)
    kind, payload = frames
    try:
        msg = msgspec.msgpack.decode(payload, type=CLIENT_KINDS[kind])
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return "error", (0, _request_id_hint(payload))
    if kind == Kind.REQUEST:  # never names the served endpoint: always refused, id echoed
        return "error", (msg.request_id,)
    if kind == Kind.PING:
        return "pong", msg.nonce
    if kind == Kind.DESCRIBE:
        return "info", None
    return "silence", None  # STOP / KILL / CREDIT of a stream that is not open


def check_answer(sent: list[bytes], answers: list[list[bytes]], instance_id: int) -> None:
    what, detail = expected_answer(sent)
    if what == "silence":
        assert answers == []
    elif what == "error":
        assert len(answers) == 1, answers
        assert_invalid(answers[0], detail)
    elif what == "pong":
        assert len(answers) == 1 and answers[0][0] == Kind.PONG, answers
        pong = _pong.decode(answers[0][1])
        assert (pong.nonce, pong.instance_id) == (detail, instance_id)
    else:
        assert len(answers) == 1 and answers[0][0] == Kind.INFO, answers
        assert _info.decode(answers[0][1]).instance_id == instance_id


async def assert_runtime_client_streams(target: Target, make_runtime) -> None:
    rt = make_runtime(static=(target.proc.address,))
    client = await rt.endpoint(target.count).client()
    await client.wait_for_instances(timeout=15)
    items = [r.data() async for r in await client.generate({"n": 40})]
    assert [it["i"] for it in items] == list(range(40))


# -- the barrages ------------------------------------------------------------------------------


async def test_random_messages(target: Target, raw: RawPeer, make_runtime) -> None:
    @SETTINGS
    @given(
        frames=st.lists(st.binary(max_size=40), min_size=1, max_size=5)
        | st.tuples(kinds, payloads).map(list)
    )
    def barrage(frames: list[bytes]) -> None:
        raw.send(*frames)
        check_answer(frames, raw.barrier(), target.proc.instance_id)

    barrage()
    target.assert_healthy(raw)
    await assert_runtime_client_streams(target, make_runtime)


async def test_truncated_requests(target: Target, raw: RawPeer, make_runtime) -> None:
    @SETTINGS
    @given(
        rid=st.integers(1, 2**63),
        window=ints,
        timeout=st.none() | st.floats(),
        request=values,
        data=st.data(),
    )
    def barrage(
        rid: int, window: int, timeout: float | None, request: Any, data: st.DataObject
    ) -> None:
        whole = encode(Request(rid, target.count, "ctx", encode_item(request), window, timeout))
        cut = data.draw(st.integers(0, len(whole) - 1), label="cut")
        raw.send(Kind.REQUEST, whole[:cut])
        [answer] = raw.barrier()
        assert_invalid(answer, (0, rid))

    barrage()
    target.assert_healthy(raw)
    await assert_runtime_client_streams(target, make_runtime)


async def test_wrongly_typed_fields_echo_the_request_id(target: Target, raw: RawPeer) -> None:
    @SETTINGS
    @given(
        kind=st.sampled_from([Kind.REQUEST, Kind.CREDIT]),
        rid=st.integers(1, 2**63),
        bad=st.sampled_from([None, b"x", 1.5, [1], {"a": 1}, True]),
        position=st.integers(1, 2),
    )
    def barrage(kind: bytes, rid: int, bad: Any, position: int) -> None:
        # REQUEST wants [int, str, str, any, ...], CREDIT [int, int]: a wrong type after the id.
        fields: list[Any] = [rid, "ns.c.e", "ctx", None] if kind == Kind.REQUEST else [rid, 1]
        fields[min(position, len(fields) - 1)] = bad
        raw.send(kind, msgspec.msgpack.encode(fields))
        [answer] = raw.barrier()
        assert_invalid(answer, (rid,))

    barrage()
    target.assert_healthy(raw)


def test_only_an_int_is_echoed_as_a_request_id(target: Target, raw: RawPeer) -> None:
    # Every client message starts with an int; anything else there is reported as request 0,
    # and the answer is always a well-typed Error (a bool in request_id would not decode as one).
    for first in (True, False, 1.0, "1", None, [1], b"\x01"):
        for kind in (Kind.STOP, Kind.KILL, Kind.CREDIT, Kind.PING, Kind.DESCRIBE, Kind.REQUEST):
            raw.send(kind, msgspec.msgpack.encode([first, "junk", "junk"]))
            [answer] = raw.barrier()
            assert_invalid(answer, (0,))
    target.assert_healthy(raw)


def test_unknown_kinds_and_frame_counts(target: Target, raw: RawPeer) -> None:
    ping = encode(Ping(1))
    for frames in (
        [b"Z", ping],
        [b"d", ping],  # a server kind sent to the server
        [b"PP", ping],
        [b"", ping],
        [b""],
        [Kind.PING],
        [Kind.PING, ping, b""],
        [Kind.REQUEST, ping, ping, ping],
    ):
        raw.send(*frames)
        [answer] = raw.barrier()
        assert_invalid(answer, (0,))
    target.assert_healthy(raw)


def test_deeply_nested_payloads_are_refused_not_fatal(target: Target, raw: RawPeer) -> None:
    deep = b"\x91" * 5000 + b"\x00"  # [[[[...0...]]]], deeper than any decoder recurses
    for kind, head in (
        (Kind.REQUEST, b"\x94\x01\xa1e\xa1c"),  # payload field
        (Kind.REQUEST, b"\x95\x01\xa1e\xa1c\xc0"),  # window field
        (Kind.PING, b"\x92\x01"),  # an unknown trailing field is still parsed
        (Kind.STOP, b"\x92\x01"),
        (Kind.KILL, b"\x92\x01"),
        (Kind.CREDIT, b"\x93\x01\x01"),
        (Kind.DESCRIBE, b"\x92\x01"),
        (Kind.PING, b""),
    ):
        raw.send(kind, head + deep)
        [answer] = raw.barrier()
        assert_invalid(answer, (0, 1))
    target.assert_healthy(raw)


async def test_valid_requests_the_server_must_refuse(
    target: Target, raw: RawPeer, make_runtime
) -> None:
    @SETTINGS
    @given(
        case=st.sampled_from(["endpoint", "id", "window"]),
        rid=st.integers(1, 2**63),
        bad_id=st.integers(-(2**63), 0),
        bad_window=st.integers(-(2**63), 0),
        endpoint=st.text(max_size=30),
    )
    def barrage(case: str, rid: int, bad_id: int, bad_window: int, endpoint: str) -> None:
        if case == "endpoint":
            if endpoint == target.count:
                endpoint += "x"
            req = Request(rid, endpoint, "ctx", encode_item({"n": 1}))
        elif case == "id":
            rid = bad_id
            req = Request(rid, target.count, "ctx", encode_item({"n": 1}))
        else:
            req = Request(rid, target.count, "ctx", encode_item({"n": 1}), bad_window)
        raw.send(Kind.REQUEST, encode(req))
        [answer] = raw.barrier()  # refused at once: no stream started, no DATA
        assert_invalid(answer, (rid,))

    barrage()
    target.assert_healthy(raw)
    await assert_runtime_client_streams(target, make_runtime)


def test_an_oversized_request_is_refused_before_its_payload_is_decoded(
    target: Target, raw: RawPeer
) -> None:
    rid = target.rid()
    blob = encode_item({"n": 1, "pad": b"x" * (MAX_REQUEST_BYTES + 1)})
    raw.send(Kind.REQUEST, encode(Request(rid, target.count, "ctx", blob)))
    [answer] = raw.barrier()
    err = assert_invalid(answer, (rid,))
    assert f"over the {MAX_REQUEST_BYTES}-byte limit" in err.message
    target.assert_healthy(raw)


def test_controls_for_unknown_streams_are_ignored(target: Target, raw: RawPeer) -> None:
    @SETTINGS
    @given(kind=st.sampled_from([Kind.STOP, Kind.KILL, Kind.CREDIT]), rid=ints, items=ints)
    def barrage(kind: bytes, rid: int, items: int) -> None:
        msg = Credit(rid, items) if kind == Kind.CREDIT else Control(rid)
        raw.send(kind, encode(msg))
        assert raw.barrier() == []  # a late STOP/KILL/CREDIT races a finished stream: not an error

    barrage()
    target.assert_healthy(raw)


def test_odd_deadlines_do_not_break_a_stream(target: Target, raw: RawPeer) -> None:
    for timeout in (None, 0.0, -1.0, float("nan"), float("inf"), 1e308, 3600.0):
        got = raw.stream(target.rid(), target.count, {"n": 5}, timeout=timeout)
        assert [it["i"] for it in got] == list(range(5)), timeout
    target.assert_healthy(raw)


def test_credit_is_only_ever_added(target: Target, raw: RawPeer) -> None:
    rid = target.rid()
    raw.send(Kind.REQUEST, encode(Request(rid, target.count, "ctx", encode_item({"n": 5}), 2)))
    got: list[Any] = []
    while len(got) < 2:
        kind, body = raw.recv()
        assert kind == Kind.DATA
        got += _data.decode(body).items
    for bad in (0, -1, -(2**63)):  # never taken away, never a reason to break the stream
        raw.send(Kind.CREDIT, encode(Credit(rid, bad)))
    assert raw.barrier() == []  # and the window is still spent: nothing more was sent
    raw.send(Kind.CREDIT, encode(Credit(rid, 10)))
    while True:
        kind, body = raw.recv()
        if kind == Kind.END:
            break
        assert kind == Kind.DATA
        got += _data.decode(body).items
    assert [decode_item(x)["i"] for x in got] == list(range(5))
    target.assert_healthy(raw)


def test_a_duplicate_request_id_leaves_the_open_stream_alone(target: Target, raw: RawPeer) -> None:
    rid = target.rid()
    slow = encode(Request(rid, target.count, "ctx", encode_item({"n": 10**6, "delay": 0.005})))
    raw.send(Kind.REQUEST, slow)
    frames = [raw.recv()]  # the stream is open once its first DATA arrived

    raw.send(Kind.REQUEST, slow)  # same id again
    raw.send(Kind.CREDIT, msgspec.msgpack.encode([rid, "not an int"]))  # bad frame naming it
    answers = raw.barrier()
    refusals = [a for a in answers if a[0] == Kind.ERROR]
    assert len(refusals) == 2
    # Both refused, but not as terminals of the open stream (request 0): that one has its own.
    duplicate, bad_credit = (assert_invalid(a, (0,)) for a in refusals)
    assert f"request id {rid} is already open" in duplicate.message
    assert "malformed" in bad_credit.message
    frames += [a for a in answers if a[0] != Kind.ERROR]

    raw.send(Kind.KILL, encode(Control(rid)))
    while frames[-1][0] == Kind.DATA:
        frames.append(raw.recv())
    assert raw.barrier() == []  # nothing after the terminal

    data = [_data.decode(f[1]) for f in frames[:-1]]
    assert all(f[0] == Kind.DATA for f in frames[:-1])
    assert [d.seq for d in data] == list(range(len(data)))
    assert all(d.request_id == rid for d in data)
    items = [decode_item(x)["i"] for d in data for x in d.items]
    assert items == list(range(len(items)))
    assert frames[-1][0] == Kind.ERROR  # exactly one terminal: Cancelled, counting every DATA
    terminal = _error.decode(frames[-1][1])
    assert (terminal.request_id, terminal.seq, terminal.kind) == (rid, len(data), "Cancelled")
    target.assert_healthy(raw)
