"""Garbage for every ZMQ port a worker or a router reads: frame generators for fuzzing.

Each generator takes a ``random.Random`` (so a hypothesis test drives it with ``st.randoms()``
and ``scripts/fuzz_frames.py`` with a seeded one) and returns the frames one peer sends:

- ``request_frames(rng, endpoint)``: what a DEALER sends a worker's request-plane ROUTER
  (random multipart, unknown kinds, truncated MessagePack, wrong types, huge ints, invalid
  UTF-8 in the endpoint name or in the request payload). ``answerable(frames)`` says whether
  the protocol promises an answer (everything but a well-formed STOP/KILL/CREDIT).
- ``replay_frames(rng)``: what a DEALER sends a worker's KV replay ROUTER.
- ``kv_event_frames(rng, seq)``: what a KV-event PUB could send, framed as message ``seq`` so
  that it never opens a gap (a gap legitimately drops the router's state).
- ``load_frames(rng, worker_id)``: what a load PUB could send.

Nothing here imports the tests: tests and scripts share it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import msgspec

from ..llm import LOAD_TOPIC
from ..wire import CLIENT_KINDS, Control, Credit, Kind, Ping, Request, encode

__all__ = [
    "PORTS",
    "answerable",
    "kv_event_frames",
    "load_frames",
    "replay_answerable",
    "replay_frames",
    "request_frames",
]

#: The ports a fuzz run targets.
PORTS = ("request", "replay", "kv_events", "load")

_HUGE = [2**63 - 1, 2**63, 2**64 - 1, -(2**63), -1, 0, 2**31, 2**32]
_KINDS = [*CLIENT_KINDS, b"d", b"x", b"", b"RR", b"\xff"]
_pack = msgspec.msgpack.encode


def _noise(rng: random.Random, most: int = 40) -> bytes:
    return rng.randbytes(rng.randint(0, most))


def _bad_utf8(rng: random.Random) -> bytes:
    """A MessagePack str header followed by bytes that are not UTF-8."""
    body = rng.choice([b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf5\x80\x80\x80", b"a\xfe"])
    return bytes([0xA0 | len(body)]) + body


def _value(rng: random.Random, depth: int = 0) -> Any:
    pick = rng.randrange(9 if depth < 3 else 6)
    if pick == 0:
        return rng.choice(_HUGE)
    if pick == 1:
        return rng.choice([None, True, False, float("nan"), float("inf"), -0.0, 1e308])
    if pick == 2:
        return "".join(chr(rng.randrange(0x20, 0x250)) for _ in range(rng.randint(0, 8)))
    if pick == 3:
        return _noise(rng, 12)
    if pick in (4, 5):
        return rng.randint(-5, 5)
    if pick in (6, 7):
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["token_ids", "stop", "max_tokens", "x", ""]): _value(rng, depth + 1)
            for _ in range(rng.randint(0, 3))}


def _with_bad_utf8(rng: random.Random, encoded: bytes, text: str) -> bytes:
    """``encoded`` with the MessagePack string ``text`` replaced by one of invalid UTF-8."""
    needle = _pack(text)
    return encoded.replace(needle, _bad_utf8(rng), 1) if needle in encoded else encoded


def _payloads(rng: random.Random) -> bytes:
    """A request payload for the served endpoint: almost, but not quite, a valid request."""
    good = {"token_ids": [1, 2, 3], "stop": {"max_tokens": 2, "stop": ["zz"]}}
    pick = rng.randrange(7)
    if pick == 0:
        return _noise(rng)
    if pick == 1:
        whole = _pack(good)
        return whole[: rng.randrange(len(whole))]  # truncated
    if pick == 2:
        return _with_bad_utf8(rng, _pack(good), rng.choice(["token_ids", "zz", "max_tokens"]))
    if pick == 3:  # huge or negative ints where the engine wants small ones
        field = rng.choice(["token_ids", "max_tokens", "stop_token_ids", "min_tokens"])
        value = rng.choice(_HUGE)
        req: dict[str, Any] = {"token_ids": [1, 2], "stop": {"max_tokens": 2}}
        if field == "token_ids":
            req["token_ids"] = [1, value]
        else:
            req["stop"][field] = [value] if field == "stop_token_ids" else value
        return _pack(req)
    if pick == 4:  # wrong types
        return _pack({rng.choice(["token_ids", "stop", "sampling"]): _value(rng)})
    if pick == 5:
        return _pack(_value(rng))
    return b"\x91" * rng.randint(100, 3000) + b"\x00"  # nested deeper than any decoder goes


def request_frames(rng: random.Random, endpoint: str) -> list[bytes]:
    """One message a hostile or broken DEALER sends a request-plane ROUTER serving
    ``endpoint``."""
    rid = rng.randint(1, 2**63 - 1)
    pick = rng.randrange(10)
    if pick == 0:  # random multipart
        return [_noise(rng) for _ in range(rng.randint(1, 5))]
    if pick == 1:  # a kind, known or not, and noise
        return [rng.choice(_KINDS), _noise(rng)]
    if pick == 2:  # a truncated request
        whole = encode(Request(rid, endpoint, "ctx", msgspec.Raw(_pack({"token_ids": [1]}))))
        return [Kind.REQUEST, whole[: rng.randrange(len(whole))]]
    if pick == 3:  # an endpoint (or context id) name of invalid UTF-8
        whole = encode(Request(rid, endpoint, "ctx-id", msgspec.Raw(_pack({"token_ids": [1]}))))
        return [Kind.REQUEST, _with_bad_utf8(rng, whole, rng.choice([endpoint, "ctx-id"]))]
    if pick == 4:  # wrong types in the request's fields
        fields: list[Any] = [rid, endpoint, "ctx", None, 16, None]
        fields[rng.randrange(1, len(fields))] = _value(rng)
        return [Kind.REQUEST, _pack(fields)]
    if pick == 5:  # huge ints and odd floats in the request's fields
        fields = [rng.choice([rid, *_HUGE]), endpoint, "ctx", None, rng.choice(_HUGE),
                  rng.choice([None, float("nan"), float("inf"), -1.0, 1e308])]
        return [Kind.REQUEST, _pack(fields)]
    if pick in (6, 7):  # a request whose payload is garbage (spliced in as it is)
        return [Kind.REQUEST, encode(Request(rid, endpoint, "ctx", msgspec.Raw(_payloads(rng))))]
    if pick == 8:  # controls and pings, valid or not
        kind = rng.choice([Kind.STOP, Kind.KILL, Kind.CREDIT, Kind.PING, Kind.DESCRIBE])
        body = rng.choice([
            encode(Control(rng.choice([*_HUGE, rid]))),
            encode(Credit(rid, rng.choice(_HUGE))),
            encode(Ping(rng.choice(_HUGE))),
            _pack([_value(rng) for _ in range(rng.randint(0, 3))]),
        ])
        return [kind, body]
    return [rng.choice(_KINDS), _pack(_value(rng))]


def answerable(frames: list[bytes]) -> bool:
    """Does the protocol promise an answer to ``frames`` from a peer with no open streams?
    Everything but a well-formed STOP, KILL or CREDIT (of a stream that is not open) is."""
    if len(frames) != 2 or frames[0] not in (Kind.STOP, Kind.KILL, Kind.CREDIT):
        return True
    try:
        msgspec.msgpack.decode(frames[1], type=CLIENT_KINDS[frames[0]])
    except Exception:
        return True
    return False


def replay_frames(rng: random.Random) -> list[bytes]:
    """One message a DEALER sends a KV replay ROUTER: ``[b"", start (u64 BE)]`` is valid."""
    pick = rng.randrange(5)
    if pick == 0:
        return [_noise(rng) for _ in range(rng.randint(1, 4))]
    if pick == 1:
        return [b"", _noise(rng, 12)]
    if pick == 2:
        return [_noise(rng, 3), rng.randrange(2**64).to_bytes(8, "big")]
    if pick == 3:
        return [b"", b"", rng.randrange(2**64).to_bytes(8, "big")]
    return [b"", rng.choice([2**64 - 1, 2**63, 10**9]).to_bytes(8, "big")]  # past the buffer


def replay_answerable(frames: list[bytes]) -> bool:
    """Is ``frames`` a replay request the ROUTER answers (the END marker at least)?"""
    return len(frames) in (1, 2) and (len(frames) == 1 or frames[0] == b"") and len(
        frames[-1]
    ) == 8


def kv_event_frames(rng: random.Random, seq: int) -> list[bytes]:
    """One message on a KV-event PUB that must leave a router's index as it was: malformed
    framing, or message ``seq`` (the next one) with a payload that is no valid batch."""
    pick = rng.randrange(4)
    if pick == 0:
        return [_noise(rng, 8) for _ in range(rng.choice([1, 2, 4, 5]))]
    if pick == 1:
        return [b"kv", rng.randbytes(rng.choice([0, 7, 9])), _noise(rng)]  # seq not 8 bytes
    head = [b"kv", seq.to_bytes(8, "big")]
    payloads: list[Callable[[], bytes]] = [
        lambda: _noise(rng),
        lambda: _pack([1.0, [["stored", [[1, 2]]]], 0])[: rng.randint(0, 10)],  # truncated
        lambda: _pack([_value(rng), _value(rng)]),  # a wrong shape
        lambda: _with_bad_utf8(rng, _pack([1.0, [{"type": "BlockStored"}], 0]), "type"),
        lambda: _pack([1.0, [{"type": "BlockStored", "block_hashes": [2**64 - 1],
                               "token_ids": "x", "block_size": -1}], 0]),
        lambda: b"\x91" * rng.randint(100, 3000) + b"\x00",
    ]
    return [*head, rng.choice(payloads)()]


def load_frames(rng: random.Random, worker_id: int) -> list[bytes]:
    """One message on a load PUB that no router may apply (malformed, or another worker's)."""
    pick = rng.randrange(5)
    if pick == 0:
        return [_noise(rng, 8) for _ in range(rng.choice([1, 3, 4]))]
    if pick == 1:
        return [LOAD_TOPIC, _noise(rng)]
    if pick == 2:
        ranks = [[rng.choice(_HUGE), -rng.randint(1, 2**63)]]  # negative blocks: never valid
        return [LOAD_TOPIC, _pack([1, worker_id, rng.choice(_HUGE), _value(rng), ranks])]
    if pick == 3:
        return [LOAD_TOPIC, _with_bad_utf8(rng, _pack([1, worker_id, 10**9, 1.0, "ranks"]),
                                           "ranks")]
    return [LOAD_TOPIC, _pack([1, worker_id + 1, 10**12, 1.0, [[0, 5]]])]  # another worker
