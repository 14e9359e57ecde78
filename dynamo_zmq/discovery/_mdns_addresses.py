"""The IPv4 addresses mDNS deals in: what an advert publishes and which of a peer's to dial.

``advert_endpoint`` turns an advert's ``tcp://host:port`` addresses into the IPv4 addresses and
the one port to publish (a wildcard bind becomes this host's addresses, or the pinned
interfaces). ``pick_ip`` chooses, among a resolved peer's addresses, one on a local network
(``local_networks``). ``local_ipv4`` lists this host's addresses (``ifaddr``).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Sequence

import ifaddr

from ..errors import InvalidArgument
from ._config import validate_address

__all__ = ["advert_endpoint", "local_ipv4", "local_networks", "pick_ip", "reachable_ipv4"]

log = logging.getLogger("dynamo_zmq.discovery.mdns")  # the logger of mDNS discovery

_WILDCARDS = ("*", "0.0.0.0")


def advert_endpoint(addresses: Iterable[str], pinned: Sequence[str]) -> tuple[list[str], int]:
    """IPv4 addresses and the port to advertise; wildcard hosts become the local addresses."""
    ips: list[str] = []
    port: int | None = None
    for address in addresses:
        host, _, port_text = validate_address(address)[len("tcp://") :].rpartition(":")
        if port is None:
            port = int(port_text)
        elif int(port_text) != port:
            log.debug("mDNS: not advertising %s: one port per advert", address)
            continue
        if host in _WILDCARDS:
            ips.extend(pinned or reachable_ipv4())
            continue
        try:
            ips.append(str(ipaddress.IPv4Address(host)))
        except ValueError:
            log.debug("mDNS: not advertising %s: host is not an IPv4 address", address)
    if port is None or not ips:
        raise InvalidArgument(f"no IPv4 tcp://host:port address to advertise in {addresses!r}")
    return list(dict.fromkeys(ips)), port


def local_ipv4() -> list[str]:
    """This host's IPv4 addresses."""
    return [str(ip.ip) for a in ifaddr.get_adapters() for ip in a.ips if isinstance(ip.ip, str)]


def reachable_ipv4() -> list[str]:
    """What a wildcard bind is advertised as: this host's addresses, loopback only if alone."""
    found = local_ipv4()
    outside = [ip for ip in found if not ipaddress.IPv4Address(ip).is_loopback]
    return outside or found


def local_networks(pinned: Sequence[str]) -> list[ipaddress.IPv4Network]:
    """Networks of the pinned interfaces, or of every interface when none is pinned."""
    return [
        ipaddress.IPv4Network(f"{ip.ip}/{ip.network_prefix}", strict=False)
        for adapter in ifaddr.get_adapters()
        for ip in adapter.ips
        if isinstance(ip.ip, str) and (not pinned or ip.ip in pinned)
    ]


def pick_ip(ips: Sequence[str], networks: Sequence[ipaddress.IPv4Network]) -> str | None:
    """The first address on one of ``networks``, preferring non-loopback; else the first."""

    def rank(ip: str) -> tuple[bool, bool]:
        addr = ipaddress.IPv4Address(ip)
        return (not any(addr in net for net in networks), addr.is_loopback)

    return min(ips, key=rank) if ips else None
