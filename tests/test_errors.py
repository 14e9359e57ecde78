"""Typed errors keep kind and message across the wire."""

from __future__ import annotations

import pytest

from dynamo_zmq import errors

ALL = [
    errors.InvalidArgument,
    errors.CannotConnect,
    errors.Disconnected,
    errors.ConnectionTimeout,
    errors.ResponseTimeout,
    errors.Cancelled,
    errors.EngineShutdown,
    errors.StreamIncomplete,
    errors.Unknown,
]


@pytest.mark.parametrize("cls", ALL)
def test_round_trip(cls):
    err = cls("something happened")
    back = errors.from_wire(err.kind, err.message)
    assert type(back) is cls
    assert back.message == "something happened"
    assert isinstance(back, errors.DynamoError)


def test_kinds_are_distinct_and_named_after_the_class():
    assert len({c.kind for c in ALL}) == len(ALL)
    assert all(c.kind == c.__name__ for c in ALL)


def test_unknown_kind_keeps_its_name():
    err = errors.from_wire("Mystery", "boom")
    assert isinstance(err, errors.Unknown)
    assert "Mystery" in err.message and "boom" in err.message


def test_foreign_exceptions_map_to_unknown():
    err = errors.from_exception(RuntimeError("bad"))
    assert isinstance(err, errors.Unknown) and "RuntimeError" in err.message
    same = errors.InvalidArgument("x")
    assert errors.from_exception(same) is same
