"""Session pins on their own (``dynamo_zmq/llm/_sessions.py``): a property test drives a table
with a hand clock against a plain model (TTL after the last use, the least recently used
evicted beyond the cap, pins learned from peers kept unless older), plus the metrics, the
frontend's session header and flags, and the replica pin messages and snapshot field."""

from __future__ import annotations

import argparse
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from dynamo_zmq.frontend._sessions import (
    MAX_SESSION_ID,
    add_session_args,
    session_config,
    session_id,
)
from dynamo_zmq.frontend.errors import HttpError
from dynamo_zmq.llm import SessionConfig, SessionPins, pin_outcome
from router._replica_sessions import (
    SESSION_TOPIC,
    PinDecodeError,
    SessionPin,
    decode_pin,
    encode_pin,
    parse_pins,
)
from router._replica_snapshot import Snapshot, SnapshotError
from tests.support.metrics import sample


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Model:
    """What the table should hold: session -> (candidate, last use, order of the write)."""

    def __init__(self, ttl: float, cap: int) -> None:
        self.ttl, self.cap = ttl, cap
        self.pins: dict[str, tuple[tuple[int, int], float, int]] = {}
        self.writes = self.expired = self.evicted = 0

    def sweep(self, now: float) -> None:
        for s in [s for s, (_, at, _) in self.pins.items() if at <= now - self.ttl]:
            del self.pins[s]
            self.expired += 1

    def get(self, s: str, now: float) -> tuple[int, int] | None:
        self.sweep(now)
        return self.pins[s][0] if s in self.pins else None

    def put(self, s: str, cand: tuple[int, int], at: float) -> None:
        self.writes += 1
        self.pins[s] = (cand, at, self.writes)
        while len(self.pins) > self.cap:
            oldest = min(self.pins, key=lambda k: self.pins[k][1:])
            del self.pins[oldest]
            self.evicted += 1

    def routed(self, s: str, cand: tuple[int, int], now: float) -> None:
        self.sweep(now)
        self.put(s, cand, now)

    def learn(self, s: str, cand: tuple[int, int], age: float, now: float) -> None:
        self.sweep(now)
        at = now - age
        if at <= now - self.ttl or (s in self.pins and self.pins[s][1] >= at):
            return
        self.put(s, cand, at)


SESSIONS = st.sampled_from(["a", "b", "c", "d", "e"])
CANDS = st.tuples(st.integers(1, 3), st.integers(0, 1))
OPS = st.lists(st.one_of(
    st.tuples(st.just("tick"), st.sampled_from([0.0, 0.5, 1.0, 2.0, 5.0])),
    st.tuples(st.just("get"), SESSIONS),
    st.tuples(st.just("routed"), SESSIONS, CANDS),
    st.tuples(st.just("learn"), SESSIONS, CANDS, st.sampled_from([0.0, 0.5, 1.5, 4.0, 9.0])),
), max_size=60)


def _counter(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return sample(generate_latest(registry).decode(), name, model="m", **labels) or 0.0


@settings(max_examples=300, deadline=None)
@given(ops=OPS, ttl=st.sampled_from([1.0, 3.0]), cap=st.integers(1, 4))
def test_the_table_holds_what_the_model_says(ops: list[Any], ttl: float, cap: int) -> None:
    clock, registry = Clock(), CollectorRegistry()
    pins = SessionPins(SessionConfig(ttl=ttl, max_sessions=cap), model="m", registry=registry,
                       clock=clock)
    model = Model(ttl, cap)
    for op in ops:
        if op[0] == "tick":
            clock.now += op[1]
        elif op[0] == "get":
            assert pins.get(op[1]) == model.get(op[1], clock.now)
        elif op[0] == "routed":
            pins.routed(op[1], op[2], "new")
            model.routed(op[1], op[2], clock.now)
        else:
            pins.learn(op[1], op[2], op[3])
            model.learn(op[1], op[2], op[3], clock.now)
        assert len(pins) <= cap
    assert {s: pins.get(s) for s in "abcde"} == {s: model.get(s, clock.now) for s in "abcde"}
    assert len(pins) == len(model.pins)
    assert _counter(registry, "dynamo_router_session_expired_total") == model.expired
    assert _counter(registry, "dynamo_router_session_evicted_total") == model.evicted
    # Least recently used first: a snapshot lists the pins by their last use.
    ages = [age for *_, age in pins.snapshot()]
    assert ages == sorted(ages, reverse=True)


def test_outcomes_are_counted_and_the_gauge_sweeps_expired_pins() -> None:
    clock, registry = Clock(), CollectorRegistry()
    pins = SessionPins(SessionConfig(ttl=10), model="m", registry=registry, clock=clock)
    for session, outcome in [("a", "new"), ("a", "pinned"), ("a", "busy"), ("b", "new"),
                             ("b", "lost")]:
        pins.routed(session, (1, 0), outcome)
    assert _counter(registry, "dynamo_router_session_new_total") == 2
    assert _counter(registry, "dynamo_router_session_pinned_total") == 1
    assert _counter(registry, "dynamo_router_session_moved_total", reason="busy") == 1
    assert _counter(registry, "dynamo_router_session_moved_total", reason="lost") == 1
    assert _counter(registry, "dynamo_router_sessions") == 2
    clock.now += 10  # both unused for the TTL: a scrape alone unpins and counts them
    assert _counter(registry, "dynamo_router_sessions") == 0
    assert _counter(registry, "dynamo_router_session_expired_total") == 2
    assert pins.get("a") is None and len(pins) == 0


def test_a_table_without_ttl_pins_nothing() -> None:
    pins = SessionPins(SessionConfig(ttl=0))
    pins.routed("a", (1, 0), "new")
    pins.learn("b", (1, 0))
    assert not pins.enabled and pins.get("a") is None and len(pins) == 0


def test_learned_pins_keep_the_order_of_their_last_use() -> None:
    clock = Clock()
    pins = SessionPins(SessionConfig(ttl=100, max_sessions=3), clock=clock)
    pins.routed("local", (1, 0), "new")
    clock.now += 10
    # A peer's snapshot: one used before "local", one after, one expired.
    pins.learn_many([("old", (2, 0), 20.0), ("recent", (3, 1), 1.0), ("gone", (2, 0), 100.0)])
    assert [s for s, *_ in pins.snapshot()] == ["old", "local", "recent"]
    pins.learn("local", (2, 0), age=30.0)  # older than this table's own use: ignored
    assert pins.get("local") == (1, 0)
    pins.routed("new", (1, 0), "new")  # the cap: the least recently used goes
    assert [s for s, *_ in pins.snapshot()] == ["local", "recent", "new"]


def test_pin_outcome() -> None:
    assert pin_outcome(None, (1, 0), lambda: True) == "new"
    assert pin_outcome((1, 0), (1, 0), lambda: True) == "pinned"
    assert pin_outcome((1, 0), (2, 0), lambda: True) == "busy"
    assert pin_outcome((1, 0), (2, 0), lambda: False) == "lost"


# -- the frontend's header and flags -------------------------------------------------------


def _scope(*headers: tuple[bytes, bytes]) -> dict[str, Any]:
    return {"headers": list(headers)}


def test_the_session_header_and_the_agents_headers() -> None:
    assert session_id(_scope()) is None
    assert session_id(_scope((b"X-Dynamo-Session-ID", b"run-42:planner"))) == "run-42:planner"
    # Dynamo's own header wins over an agent's; among agents', the documented order.
    assert session_id(_scope((b"x-session-id", b"oc"), (b"x-dynamo-session-id", b"dyn"))) == "dyn"
    assert session_id(_scope((b"x-claude-code-session-id", b"root"),
                             (b"x-claude-code-agent-id", b"child"))) == "child"
    assert session_id(_scope((b"session-id", b"codex"))) == "codex"


@pytest.mark.parametrize("value", [b"", b"x" * (MAX_SESSION_ID + 1), b"caf\xc3\xa9", b"a\tb"])
def test_a_bad_session_id_is_a_400(value: bytes) -> None:
    with pytest.raises(HttpError) as err:
        session_id(_scope((b"x-dynamo-session-id", value)))
    assert err.value.status == 400 and err.value.param == "x-dynamo-session-id"
    assert "printable ASCII" in err.value.message


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_session_args(parser)
    return parser.parse_args(argv)


def test_session_flags_and_their_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    assert session_config(_args()) == SessionConfig(ttl=300.0, max_sessions=100_000)
    assert session_config(_args("--session-ttl", "0")).enabled is False
    monkeypatch.setenv("DYN_SESSION_TTL", "2.5")
    monkeypatch.setenv("DYN_MAX_SESSIONS", "7")
    assert session_config(_args()) == SessionConfig(ttl=2.5, max_sessions=7)
    for argv, message in [(("--session-ttl", "-1"), "--session-ttl must be"),
                          (("--session-ttl", "inf"), "--session-ttl must be"),
                          (("--max-sessions", "0"), "--max-sessions must be >= 1")]:
        with pytest.raises(Exception, match=message):
            session_config(_args(*argv))


# -- what replicas send each other ---------------------------------------------------------


def test_pin_messages_round_trip_and_bad_ones_are_refused() -> None:
    pin = SessionPin(1, 0xABC, "s-1", 0x123, 1)
    assert decode_pin([SESSION_TOPIC, encode_pin(pin)]) == pin
    bad = [
        [SESSION_TOPIC],
        [b"kv-replica", encode_pin(pin)],
        [SESSION_TOPIC, b"\xc1garbage"],
        [SESSION_TOPIC, encode_pin(SessionPin(2, 1, "s", 1, 0))],
        [SESSION_TOPIC, encode_pin(SessionPin(1, 1, "", 1, 0))],
        [SESSION_TOPIC, encode_pin(SessionPin(1, 1, "x" * 300, 1, 0))],
        [SESSION_TOPIC, encode_pin(SessionPin(1, 1, "s", -1, 0))],
        [SESSION_TOPIC, msgspec.msgpack.encode([1, 1, 5, 1, 0])],
    ]
    for frames in bad:
        with pytest.raises(PinDecodeError):
            decode_pin(frames)


def test_snapshot_sessions_parse_or_refuse_the_snapshot() -> None:
    base = {"seq": 3, "requests": []}
    assert Snapshot.parse(base).sessions == []  # a peer of before: no pins
    snap = Snapshot.parse({**base, "sessions": [["s", 7, 0, 1.5], ["t", 8, 1, 0]]})
    assert snap.sessions == [("s", (7, 0), 1.5), ("t", (8, 1), 0.0)]
    for sessions in ([["s", 7, 0]], [["s", -7, 0, 1.0]], [["", 7, 0, 1.0]], [["s", 7, 0, -1]],
                     "s"):
        assert parse_pins(sessions) is None
        with pytest.raises(SnapshotError):
            Snapshot.parse({**base, "sessions": sessions})
