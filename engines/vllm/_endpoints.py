"""Endpoint helpers of the vLLM adapter: free ports for vLLM's KV-event sockets, the addresses
routers connect to, and vLLM's version."""

from __future__ import annotations

import random
import socket

__all__ = ["KV_CONNECTOR", "KV_CONNECTOR_MODULE", "advertise", "free_port", "offset",
           "vllm_version"]

#: Our KV connector for disaggregated prefill/decode, as vLLM's ``kv_transfer_config`` names it.
KV_CONNECTOR = "DynamoZmqConnector"
KV_CONNECTOR_MODULE = "engines.vllm._kv_connector"


def free_port(exclude: int = 0) -> int:
    """A free TCP port (other than ``exclude``) for a socket vLLM binds seconds later, in its
    engine process: one below the kernel's ephemeral range when one is free there, since a
    port from that range may meanwhile go to any outgoing connection or ``bind(0)`` on the host
    (``Address already in use`` when vLLM binds it)."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(max(1024, low - 12288), low)
        if port != exclude and _bindable(port):
            return port
    while True:  # that range is full: any free port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = int(sock.getsockname()[1])
        if port != exclude:
            return port


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out on its own (Linux; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return max(2048, int(f.read().split()[0]))
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


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

