"""Discovery settings: which backend, and its options, from flags or ``DYN_*`` variables.

DYN_DISCOVERY         mdns | static                    (--discovery)
DYN_STATIC_WORKERS    tcp://host:port,tcp://host:port  (--static-workers)
DYN_STATIC_FILE       path, one address a line, '#' comments  (--static-file)
DYN_MDNS_INTERFACES   comma-separated IPv4 addresses   (--mdns-interfaces)
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidArgument

BACKENDS = ("mdns", "static")


@dataclass(frozen=True)
class DiscoveryConfig:
    """How this process finds its peers.

    Attributes:
        backend: ``"mdns"`` (advertise and browse on the LAN) or ``"static"`` (a fixed list).
        static_addresses: ``tcp://host:port`` peers for the static backend.
        static_file: a file of peers for the static backend, re-read when it changes.
        mdns_interfaces: IPv4 addresses to pin mDNS to; ``None`` (or empty) uses all interfaces.
    """

    backend: str = "mdns"
    static_addresses: tuple[str, ...] = ()
    static_file: str | None = None
    mdns_interfaces: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise InvalidArgument(
                f"unknown discovery backend {self.backend!r}; expected one of {', '.join(BACKENDS)}"
            )
        for address in self.static_addresses:
            validate_address(address)
        # A static list may be empty: a serving process in static mode needs no peers.
        for ip in self.mdns_interfaces or ():
            _validate_ipv4(ip)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> DiscoveryConfig:
        """Build from ``DYN_DISCOVERY``, ``DYN_STATIC_WORKERS``, ``DYN_STATIC_FILE``,
        ``DYN_MDNS_INTERFACES``.

        Raises:
            InvalidArgument: a value is malformed.
        """
        interfaces = split_list(environ.get("DYN_MDNS_INTERFACES", ""))
        return cls(
            backend=environ.get("DYN_DISCOVERY", "").strip() or "mdns",
            static_addresses=split_list(environ.get("DYN_STATIC_WORKERS", "")),
            static_file=environ.get("DYN_STATIC_FILE", "").strip() or None,
            mdns_interfaces=interfaces or None,
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DiscoveryConfig:
        """Build from a namespace parsed with the flags of :func:`add_discovery_args`.

        Raises:
            InvalidArgument: a value is malformed.
        """
        interfaces = split_list(getattr(args, "mdns_interfaces", None) or "")
        return cls(
            backend=getattr(args, "discovery", None) or "mdns",
            static_addresses=split_list(getattr(args, "static_workers", None) or ""),
            static_file=getattr(args, "static_file", None) or None,
            mdns_interfaces=interfaces or None,
        )


def add_discovery_args(
    parser: argparse.ArgumentParser, environ: Mapping[str, str] = os.environ
) -> None:
    """Add ``--discovery``, ``--static-workers``, ``--static-file`` and ``--mdns-interfaces``.

    Defaults come from the matching ``DYN_*`` variables in ``environ``.
    """
    group = parser.add_argument_group("discovery")
    group.add_argument(
        "--discovery",
        choices=BACKENDS,
        default=environ.get("DYN_DISCOVERY", "").strip() or "mdns",
        help="how to find peers (env DYN_DISCOVERY; default %(default)s)",
    )
    group.add_argument(
        "--static-workers",
        default=environ.get("DYN_STATIC_WORKERS") or None,
        metavar="ADDRS",
        help="comma-separated tcp://host:port peers for static discovery (env DYN_STATIC_WORKERS)",
    )
    group.add_argument(
        "--static-file",
        default=environ.get("DYN_STATIC_FILE") or None,
        metavar="PATH",
        help="file of peers, one a line, '#' comments, re-read on change (env DYN_STATIC_FILE)",
    )
    group.add_argument(
        "--mdns-interfaces",
        default=environ.get("DYN_MDNS_INTERFACES") or None,
        metavar="IPS",
        help="comma-separated IPv4 addresses to pin mDNS to (env DYN_MDNS_INTERFACES; default all)",
    )


def split_list(value: str) -> tuple[str, ...]:
    """Split a comma-separated value, dropping blanks."""
    return tuple(part.strip() for part in value.split(",") if part.strip())


def validate_address(address: str) -> str:
    """Return ``address`` if it is ``tcp://host:port`` with a valid port.

    Raises:
        InvalidArgument: it is not.
    """
    prefix = "tcp://"
    hint = f"invalid peer address {address!r}: expected tcp://host:port"
    if not address.startswith(prefix):
        raise InvalidArgument(hint)
    host, sep, port = address[len(prefix) :].rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or any(c.isspace() or c in "/?#" for c in host):
        raise InvalidArgument(hint)
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"{hint} (port must be 1-65535)")
    return address


def parse_static_file(text: str) -> tuple[str, ...]:
    """Addresses in a static file's text: one a line, blank lines and ``#`` comments skipped.

    Raises:
        InvalidArgument: a line is not a valid address.
    """
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return _unique(validate_address(line) for line in lines if line)


def read_static_file(path: str) -> tuple[str, ...]:
    """Read and parse a static file.

    Raises:
        InvalidArgument: it cannot be read, or a line is not a valid address.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidArgument(f"cannot read static discovery file {path!r}: {exc}") from exc
    return parse_static_file(text)


def _unique(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


def _validate_ipv4(ip: str) -> None:
    try:
        ipaddress.IPv4Address(ip)
    except ValueError as exc:
        raise InvalidArgument(f"invalid mDNS interface {ip!r}: expected an IPv4 address") from exc
