"""Discovery settings: which backends, and their options, from flags or ``DYN_*`` variables.

DYN_DISCOVERY         mdns | static | dir, or several comma-joined (mdns,dir)  (--discovery)
DYN_STATIC_WORKERS    tcp://host:port,tcp://host:port  (--static-workers)
DYN_STATIC_FILE       path, one address a line, '#' comments  (--static-file)

With auth on, a static entry names the peer's CURVE public key after its address:
``tcp://host:port key=<40 characters of Z85>`` (the key may hold '#': a comment starts only
where a '#' begins a word).
DYN_MDNS_INTERFACES   comma-separated IPv4 addresses   (--mdns-interfaces)
DYN_DISCOVERY_DIR     a directory every host mounts, for the dir backend  (--discovery-dir)
DYN_DISCOVERY_DIR_WATCH  auto | inotify | poll          (--discovery-dir-watch)
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from zmq.utils import z85

from ..errors import InvalidArgument

BACKENDS = ("mdns", "static", "dir")
#: How a discovery directory is followed: inotify on a local filesystem, polling on a network
#: one (``auto``), or either always.
DIR_WATCH_MODES = ("auto", "inotify", "poll")


@dataclass(frozen=True)
class DiscoveryConfig:
    """How this process finds its peers.

    Attributes:
        backend: ``"mdns"`` (advertise and browse on the LAN), ``"static"`` (a fixed list),
            ``"dir"`` (advert files in a shared directory), or several comma-joined
            (``"mdns,dir"``: each advert goes to both, peers come from both).
        static_addresses: ``tcp://host:port`` peers for the static backend, each optionally
            followed by `` key=<Z85 public key>``.
        static_file: a file of peers for the static backend, re-read when it changes.
        mdns_interfaces: IPv4 addresses to pin mDNS to; ``None`` (or empty) uses all interfaces.
        discovery_dir: the shared directory of the ``dir`` backend.
        dir_watch: how the directory is followed (``DIR_WATCH_MODES``).
    """

    backend: str = "mdns"
    static_addresses: tuple[str, ...] = ()
    static_file: str | None = None
    mdns_interfaces: tuple[str, ...] | None = None
    discovery_dir: str | None = None
    dir_watch: str = "auto"

    def __post_init__(self) -> None:
        names = self.backends
        unknown = [b for b in names if b not in BACKENDS]
        if unknown or not names or len(set(names)) != len(names):
            raise InvalidArgument(
                f"unknown discovery backend {self.backend!r}; expected one of "
                f"{', '.join(BACKENDS)}, or several comma-joined (mdns,dir)"
            )
        if "dir" in names and not self.discovery_dir:
            raise InvalidArgument("--discovery dir needs --discovery-dir PATH (DYN_DISCOVERY_DIR)")
        if self.discovery_dir and "dir" not in names:
            raise InvalidArgument(
                f"--discovery-dir is set but --discovery is {self.backend!r}: use "
                f"--discovery dir (or {self.backend},dir)"
            )
        if self.dir_watch not in DIR_WATCH_MODES:
            raise InvalidArgument(f"--discovery-dir-watch must be one of "
                                  f"{', '.join(DIR_WATCH_MODES)}, got {self.dir_watch!r}")
        for entry in self.static_addresses:
            split_entry(entry)
        # A static list may be empty: a serving process in static mode needs no peers.
        for ip in self.mdns_interfaces or ():
            _validate_ipv4(ip)

    @property
    def backends(self) -> tuple[str, ...]:
        """The backends ``backend`` names, in order."""
        return split_list(self.backend)

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
            discovery_dir=environ.get("DYN_DISCOVERY_DIR", "").strip() or None,
            dir_watch=environ.get("DYN_DISCOVERY_DIR_WATCH", "").strip() or "auto",
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
            discovery_dir=getattr(args, "discovery_dir", None) or None,
            dir_watch=getattr(args, "discovery_dir_watch", None) or "auto",
        )


def add_discovery_args(
    parser: argparse.ArgumentParser, environ: Mapping[str, str] = os.environ
) -> None:
    """Add ``--discovery``, ``--static-workers``, ``--static-file``, ``--mdns-interfaces``,
    ``--discovery-dir`` and ``--discovery-dir-watch``.

    Defaults come from the matching ``DYN_*`` variables in ``environ``.
    """
    group = parser.add_argument_group("discovery")
    group.add_argument(
        "--discovery",
        default=environ.get("DYN_DISCOVERY", "").strip() or "mdns",
        metavar="{mdns,static,dir}",
        help="how to find peers: mdns, static, dir (a shared directory), or several "
             "comma-joined, e.g. mdns,dir [DYN_DISCOVERY; default %(default)s]",
    )
    group.add_argument(
        "--static-workers",
        default=environ.get("DYN_STATIC_WORKERS") or None,
        metavar="ADDRS",
        help="comma-separated tcp://host:port peers for static discovery [DYN_STATIC_WORKERS]",
    )
    group.add_argument(
        "--static-file",
        default=environ.get("DYN_STATIC_FILE") or None,
        metavar="PATH",
        help="file of peers, one a line, '#' comments, re-read on change [DYN_STATIC_FILE]",
    )
    group.add_argument(
        "--discovery-dir",
        default=environ.get("DYN_DISCOVERY_DIR") or None,
        metavar="PATH",
        help="directory every host mounts (NFS, Lustre, GPFS) for --discovery dir: adverts "
             "are files there [DYN_DISCOVERY_DIR]",
    )
    group.add_argument(
        "--discovery-dir-watch",
        choices=DIR_WATCH_MODES,
        default=environ.get("DYN_DISCOVERY_DIR_WATCH", "").strip() or "auto",
        help="follow the directory with inotify, by polling, or auto: inotify on a local "
             "filesystem, polling on a network one [DYN_DISCOVERY_DIR_WATCH; default "
             "%(default)s]",
    )
    group.add_argument(
        "--mdns-interfaces",
        default=environ.get("DYN_MDNS_INTERFACES") or None,
        metavar="IPS",
        help="comma-separated IPv4 addresses to pin mDNS to [DYN_MDNS_INTERFACES; default all]",
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


def split_entry(entry: str) -> tuple[str, bytes | None]:
    """``(address, key or None)`` of a static entry ``tcp://host:port [key=<Z85>]``.

    Raises:
        InvalidArgument: the address is invalid, or the key is not 40 characters of Z85.
    """
    address, *rest = entry.split()
    key: bytes | None = None
    for word in rest:
        name, sep, value = word.partition("=")
        if name != "key" or not sep or key is not None:
            raise InvalidArgument(f"invalid peer entry {entry!r}: expected tcp://host:port "
                                  "[key=<Z85 public key>]")
        key = _z85_key(value, entry)
    return validate_address(address), key


def _z85_key(value: str, entry: str) -> bytes:
    raw = value.encode("ascii", "replace")
    try:
        valid = len(raw) == 40 and len(z85.decode(raw)) == 32
    except (ValueError, KeyError, TypeError, struct.error):
        valid = False
    if not valid:
        raise InvalidArgument(f"invalid key in peer entry {entry!r}: expected 40 characters of "
                              "Z85 (python -m dynamo_zmq.keys public DIR prints one)")
    return raw


def parse_static_file(text: str) -> tuple[str, ...]:
    """Entries in a static file's text: one a line, blank lines and ``#`` comments skipped
    (a key is 40 characters and may hold a ``#``: a comment after it starts at character 41).

    Raises:
        InvalidArgument: a line is not a valid entry.
    """
    entries = []
    for line in text.splitlines():
        words: list[str] = []
        for word in line.split():
            if word.startswith("key=") and words:
                word, comment = word[:44], word[44:]
            else:
                word, _, comment = word.partition("#")
            if word:
                words.append(word)
            if comment or not word:
                break
        if words:
            entry = " ".join(words)
            split_entry(entry)
            entries.append(entry)
    return _unique(entries)


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
