"""Calls a harness makes into a ``Cluster`` host: HTTP GETs to a frontend through the host's
Unix-socket forwarder, and a load process (``tools.chaos_load``) run inside the host."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time
from pathlib import Path

import msgspec

from .chaos_load import LoadResult, LoadSpec
from .netns import Host

__all__ = ["HTTP_PORT", "get", "instances", "run_load", "wait_instances"]

#: The port harness frontends serve HTTP on, inside their hosts.
HTTP_PORT = 8000


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def get(host: Host, path: str, port: int = HTTP_PORT, timeout: float = 10.0) -> tuple[int, str]:
    """``GET path`` on ``127.0.0.1:port`` inside ``host``: the status and the body.

    Raises:
        OSError, http.client.HTTPException: the frontend did not answer.
    """
    conn = _UnixHTTP(host.uds(port), timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def instances(host: Host, model: str, port: int = HTTP_PORT) -> set[int]:
    """The instance ids the frontend on ``host`` routes ``model`` to now (its ``/health``);
    empty when it does not answer."""
    try:
        status, body = get(host, "/health", port)
    except (OSError, http.client.HTTPException):
        return set()
    if status != 200:
        return set()
    return {int(i, 16) for i in json.loads(body)["models"].get(model, [])}


async def wait_instances(host: Host, model: str, count: int, timeout: float = 60.0) -> None:
    """Until the frontend on ``host`` routes ``model`` to at least ``count`` instances.

    Raises:
        TimeoutError: it did not within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    seen: set[int] = set()
    while time.monotonic() < deadline:
        seen = await asyncio.to_thread(instances, host, model)
        if len(seen) >= count:
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"frontend on {host.name} sees {len(seen)} of {count} workers")


def run_load(host: Host, spec: LoadSpec) -> LoadResult:
    """Run one load process (``tools.chaos_load``) inside ``host`` to its end.

    Raises:
        RuntimeError: the load process failed.
    """
    tmp = Path(host.cluster.tmp)
    spec_file = tmp / f"load-{host.name}-{time.monotonic_ns()}.json"
    out = spec_file.with_suffix(".out")
    spec_file.write_bytes(msgspec.json.encode(spec))
    proc = host.python("-m", "dynamo_zmq.tools.chaos_load", str(spec_file), str(out),
                       timeout=60.0)
    limit = spec.start_at - time.monotonic() + spec.duration + spec.deadline + spec.margin
    code = proc.wait(timeout=max(limit, 0) + 60 + (600 if spec.duration <= 0 else 0))
    if code != 0:
        raise RuntimeError(f"load process exited {code}:\n{proc.logs()}")
    return msgspec.json.decode(out.read_bytes(), type=LoadResult)
