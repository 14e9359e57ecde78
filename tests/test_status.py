"""``python -m dynamo_zmq status`` against real serving processes (mDNS on loopback, static)."""

from __future__ import annotations

import signal
import socket

from dynamo_zmq.tools.status import format_age
from tests.conftest import app_args
from tests.support.procs import run_cli, status_json


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_row(row: dict, namespace: str, component: str, endpoints: list[str], proc) -> None:
    assert row["namespace"] == namespace
    assert row["component"] == component
    assert row["endpoints"] == endpoints
    assert row["instance_id"] == f"{proc.instance_id:x}"
    assert row["address"] == proc.address
    assert row["age"] >= 0
    assert row["state"] == "ready"
    assert row["pid"] == proc.pid


def test_format_age() -> None:
    assert [format_age(s) for s in (None, -1, 0, 12.7, 60, 185, 7200, 90000)] == [
        "-", "0s", "0s", "12s", "1m", "3m", "2h", "1d",
    ]  # fmt: skip


def test_lists_mdns_instances_of_the_namespace_only(namespace, spawn) -> None:
    first = spawn(*app_args(namespace))
    second = spawn(*app_args(namespace, "--role", "middle", "--component", "middle"))
    other = spawn(*app_args(f"{namespace}x"))

    rows = status_json("--namespace", namespace, "--wait", "3")

    by_component = {row["component"]: row for row in rows}
    assert len(rows) == 2, rows
    assert_row(by_component["backend"], namespace, "backend", ["count", "journal"], first)
    assert_row(by_component["middle"], namespace, "middle", ["relay"], second)
    assert f"{other.instance_id:x}" not in {row["instance_id"] for row in rows}


def test_static_list_shows_gone_and_unreachable_peers(namespace, spawn, taken_port) -> None:
    server = spawn(*app_args(namespace, "--discovery", "static"))
    dead = f"tcp://127.0.0.1:{free_port()}"  # nothing listens: refused at once
    silent = f"tcp://127.0.0.1:{taken_port}"  # accepts TCP but never answers: a hung process

    rows = status_json(
        "--namespace", namespace, "--wait", "2",
        "--discovery", "static", "--static-workers", f"{server.address},{dead},{silent}",
    )  # fmt: skip

    assert len(rows) == 3, rows
    live = [row for row in rows if row["state"] not in ("gone", "unreachable")]
    assert len(live) == 1
    assert_row(live[0], namespace, "backend", ["count", "journal"], server)
    by_address = {row["address"]: row for row in rows}
    assert by_address[dead]["state"] == "gone"
    assert by_address[silent]["state"] == "unreachable"
    for row in (by_address[dead], by_address[silent]):
        assert row["instance_id"] is None and row["age"] is None and row["namespace"] is None


def test_a_killed_static_worker_is_gone_at_once(namespace, spawn) -> None:
    server = spawn(*app_args(namespace, "--discovery", "static"))
    static = ("--discovery", "static", "--static-workers", server.address)
    (row,) = status_json("--namespace", namespace, "--wait", "5", *static)
    assert_row(row, namespace, "backend", ["count", "journal"], server)

    server.signal(signal.SIGKILL)
    server.wait()
    (row,) = status_json("--namespace", namespace, "--wait", "5", *static)

    assert row["state"] == "gone" and row["address"] == server.address


def test_a_killed_mdns_worker_is_gone_while_its_record_lingers(namespace, spawn) -> None:
    killed = spawn(*app_args(namespace))
    alive = spawn(*app_args(namespace, "--component", "other"))
    ids = {f"{killed.instance_id:x}", f"{alive.instance_id:x}"}
    rows = status_json("--namespace", namespace, "--wait", "3")
    assert {row["instance_id"] for row in rows} == ids

    killed.signal(signal.SIGKILL)  # no goodbye: its record lives on in caches for its TTL
    killed.wait()
    # A fresh browser hears no answer for the dead instance: it is not listed as live. (4 s:
    # time for the live one's answer on a loaded machine.)
    rows = status_json("--namespace", namespace, "--wait", "4")
    live = [row["instance_id"] for row in rows if row["state"] == "ready"]
    assert live == [f"{alive.instance_id:x}"]
    assert all(row["state"] == "gone" for row in rows if row["instance_id"] not in live)

    # Where the record is still answered (a cache, a reflector, a sleep proxy), status checks the
    # instance itself and shows it gone, with what the record said.
    hex_id = f"{killed.instance_id:x}"
    spawn("-m", "tests.support.mdns_record", namespace, hex_id, killed.address, "backend")
    rows = status_json("--namespace", namespace, "--wait", "4")
    by_id = {row["instance_id"]: row for row in rows}
    assert set(by_id) == ids, rows
    assert by_id[f"{alive.instance_id:x}"]["state"] == "ready"
    gone = by_id[f"{killed.instance_id:x}"]
    assert gone["state"] == "gone", gone
    assert (gone["namespace"], gone["component"], gone["address"]) == (
        namespace, "backend", killed.address,
    )  # fmt: skip


def test_table_shows_the_instance(namespace, spawn) -> None:
    server = spawn(*app_args(namespace))

    result = run_cli("-m", "dynamo_zmq", "status", "--namespace", namespace, "--wait", "3")

    assert result.returncode == 0, result.stderr
    header, *lines = result.stdout.splitlines()
    assert header.split() == [
        "NAMESPACE", "COMPONENT", "ENDPOINTS", "INSTANCE", "ADDRESS", "AGE", "STATE",
    ]  # fmt: skip
    assert len(lines) == 1, result.stdout
    cells = lines[0].split()
    assert cells[:5] == [
        namespace,
        "backend",
        "count,journal",
        f"{server.instance_id:x}",
        server.address,
    ]
    assert cells[5].endswith("s") and cells[6] == "ready"


def test_nothing_found_is_not_an_error(namespace) -> None:
    assert status_json("--namespace", namespace, "--wait", "0.5") == []
    result = run_cli("-m", "dynamo_zmq", "status", "--namespace", namespace, "--wait", "0.5")
    assert result.returncode == 0
    assert "no instances found" in result.stdout


def test_a_wait_that_is_not_finite_is_a_usage_error(namespace) -> None:
    result = run_cli("-m", "dynamo_zmq", "status", "--namespace", namespace, "--wait", "nan")
    assert result.returncode == 2 and "--wait must be a finite number >= 0" in result.stderr
