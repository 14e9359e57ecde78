"""Ports and endpoint strings of vLLM's KV-event sockets."""

from __future__ import annotations

import socket

__all__ = ["advertise_endpoint", "free_port", "offset_endpoint"]


def free_port(exclude: int = 0) -> int:
    """A TCP port free now (other than ``exclude``)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = int(sock.getsockname()[1])
        if port != exclude:
            return port


def advertise_endpoint(endpoint: str | None, host: str) -> str | None:
    """``tcp://*:PORT`` -> ``tcp://HOST:PORT`` (other endpoints are kept as they are)."""
    if not endpoint:
        return None
    scheme, _, rest = endpoint.partition("://")
    addr, _, port = rest.rpartition(":")
    if scheme == "tcp" and addr in ("*", "0.0.0.0", "[::]", "::"):
        return f"tcp://{host}:{port}"
    return endpoint


def offset_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint of data-parallel rank ``rank``: vLLM offsets the port by the rank."""
    if rank == 0 or not endpoint.startswith("tcp://"):
        return endpoint
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"
