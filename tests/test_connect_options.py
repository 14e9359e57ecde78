"""Every socket that connects bounds its connect, its reconnect interval and how long a dead
connection lingers (issue 33 item 2): ``ZMQ_CONNECT_TIMEOUT``, ``RECONNECT_IVL_MAX`` and
``ZMQ_TCP_MAXRT``. The behaviour they buy, a worker routed to again within a second of a healed
partition, is tested on namespace hosts in ``test_cluster_rejoin.py``; here, that every
connecting socket has them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import zmq

from dynamo_zmq.resources import process_zmq_context
from dynamo_zmq.transport import make_socket
from dynamo_zmq.transport._sockets import (
    CONNECT_TIMEOUT_MS,
    RECONNECT_IVL_MAX_MS,
    RECONNECT_IVL_MS,
    TCP_MAXRT_MS,
)

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dynamo_zmq", "router", "engines")
CONNECTING = {zmq.DEALER: "DEALER", zmq.SUB: "SUB", zmq.REQ: "REQ", zmq.PUSH: "PUSH"}


def _options(sock: zmq.Socket[bytes]) -> dict[str, object]:
    return {name: sock.getsockopt(getattr(zmq, name))
            for name in ("CONNECT_TIMEOUT", "TCP_MAXRT", "RECONNECT_IVL", "RECONNECT_IVL_MAX")}


@pytest.mark.parametrize("kind", list(CONNECTING), ids=list(CONNECTING.values()))
def test_a_connecting_socket_bounds_its_connects(kind: int) -> None:
    sock = make_socket(process_zmq_context(), kind, connect="tcp://127.0.0.1:9")
    try:
        assert _options(sock) == {
            "CONNECT_TIMEOUT": CONNECT_TIMEOUT_MS, "TCP_MAXRT": TCP_MAXRT_MS,
            "RECONNECT_IVL": RECONNECT_IVL_MS, "RECONNECT_IVL_MAX": RECONNECT_IVL_MAX_MS,
        }
    finally:
        sock.close(linger=0)


def test_a_socket_made_to_connect_later_has_them_too() -> None:
    # PeerConnection makes its DEALER unconnected (a monitor goes on before the connect).
    sock = make_socket(process_zmq_context(), zmq.DEALER)
    try:
        assert _options(sock)["CONNECT_TIMEOUT"] == CONNECT_TIMEOUT_MS
        assert _options(sock)["TCP_MAXRT"] == TCP_MAXRT_MS
    finally:
        sock.close(linger=0)


def _calls(node: ast.AST) -> list[str]:
    return [c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", "")
            for c in ast.walk(node) if isinstance(c, ast.Call)]


def _makes_zmq_socket(node: ast.AST) -> bool:
    """``something.socket(zmq.KIND)`` is called within ``node``."""
    return any(
        isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "socket"
        and c.args and isinstance(c.args[0], ast.Attribute)
        and isinstance(c.args[0].value, ast.Name) and c.args[0].value.id == "zmq"
        for c in ast.walk(node)
    )


def test_every_socket_made_outside_make_socket_that_connects_sets_them() -> None:
    """A ZMQ socket made directly (``ctx.socket(...)``) and connected in the same function
    calls ``set_connect_options`` (the only way to get the options without ``make_socket``)."""
    missing = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path.name == "_sockets.py":
                continue
            tree = ast.parse(path.read_text(), str(path))
            for fn in ast.walk(tree):
                if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                calls = _calls(fn)
                if _makes_zmq_socket(fn) and "connect" in calls and (
                        "set_connect_options" not in calls):
                    missing.append(f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name}")
    assert not missing, missing
