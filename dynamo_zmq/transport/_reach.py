"""Which address of a multi-homed peer to dial for its other endpoints.

A process bound on every interface advertises its request plane at each of its addresses
(``Description.hosts``), and its other endpoints (KV events and replay, load reports, a router
replica's events), which bind every interface too, at the first of them. A caller on another of
its networks cannot reach that one: it dials them at the address it reached the request plane
at, which is on a network it is attached to.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["endpoint_via"]


def endpoint_via(endpoint: str, dialed: str, hosts: Sequence[str]) -> str:
    """``endpoint`` (``tcp://host:port``) as reached by a caller that dialed the peer's request
    plane at ``dialed``: at ``dialed``'s host when both hosts are among the peer's ``hosts``
    (its request plane's advertised addresses); else unchanged (a pinned address, another
    host's, or a peer that advertises one address).
    """
    host, port = _split(endpoint)
    via, _ = _split(dialed)
    if host == via or host not in hosts or via not in hosts:
        return endpoint
    return f"tcp://{via}:{port}"


def _split(address: str) -> tuple[str, str]:
    """``(host, port)`` of ``tcp://host:port``; ``("", "")`` for anything else."""
    if not address.startswith("tcp://"):
        return "", ""
    host, sep, port = address[len("tcp://"):].rpartition(":")
    return (host, port) if sep and host and port else ("", "")
