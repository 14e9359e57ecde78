"""Endpoint helpers of the vLLM adapter: free ports for vLLM's KV-event sockets, the addresses
routers connect to, and vLLM's version."""

from __future__ import annotations

import socket

__all__ = ["KV_CONNECTOR", "KV_CONNECTOR_MODULE", "advertise", "free_port", "offset",
           "vllm_version"]

#: Our KV connector for disaggregated prefill/decode, as vLLM's ``kv_transfer_config`` names it.
KV_CONNECTOR = "DynamoZmqConnector"
KV_CONNECTOR_MODULE = "engines.vllm._kv_connector"


def free_port(exclude: int = 0) -> int:
    """A free TCP port (other than ``exclude``)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = int(sock.getsockname()[1])
        if port != exclude:
            return port


def advertise(endpoint: str | None, host: str) -> str | None:
    """``tcp://*:PORT`` -> ``tcp://HOST:PORT`` (other endpoints are kept as they are)."""
    if not endpoint:
        return None
    scheme, _, rest = endpoint.partition("://")
    addr, _, port = rest.rpartition(":")
    if scheme == "tcp" and addr in ("*", "0.0.0.0", "[::]", "::"):
        return f"tcp://{host}:{port}"
    return endpoint


def offset(endpoint: str, rank: int) -> str:
    """The endpoint of data-parallel rank ``rank`` (vLLM offsets the port by the rank)."""
    if rank == 0 or not endpoint.startswith("tcp://"):
        return endpoint
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


def vllm_version() -> str:
    try:
        from vllm import __version__
    except ImportError:  # pragma: no cover
        return "unknown"
    return str(__version__)

