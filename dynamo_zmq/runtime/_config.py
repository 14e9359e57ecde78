"""Runtime settings: where the ROUTER socket binds, how peers are found, liveness timings.

DYN_HOST    address to bind the request plane on (--host); default 0.0.0.0, or the first pinned
            mDNS interface when DYN_MDNS_INTERFACES is set
DYN_PORT    port to bind (--port); 0 picks a free one
DYN_ADVERTISE_HOST  the one IPv4 address every endpoint of this process is advertised at
            (--advertise-host); default: the bind address, or every interface's for a wildcard
DYN_AUTH_KEYS   a key directory (--auth-keys): CURVE on every socket, peers' keys checked against
                DIR/authorized (``python -m dynamo_zmq.keys``); unset: auth off
DYN_AUTH_KEY_NAME  which keypair of that directory is this process's (--auth-key-name)
DYN_HEALTH_CHECK_ENABLED, DYN_CANARY_WAIT_TIME, DYN_HEALTH_CHECK_REQUEST_TIMEOUT
            health canaries of endpoints served with a ``health_check_payload``
plus the discovery variables of ``dynamo_zmq.discovery`` (DYN_DISCOVERY, ...).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..discovery import DiscoveryConfig, add_discovery_args, reachable_ipv4
from ..errors import InvalidArgument
from ..transport._keyfiles import DEFAULT_NAME as DEFAULT_KEY_NAME
from ..transport._keyfiles import authorized_keys, load_keypair
from ..transport.server import KILL_GRACE
from ._canary import CanaryConfig

__all__ = ["RuntimeConfig", "add_auth_args", "add_runtime_args", "auth_from_args"]


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything a ``DistributedRuntime`` needs to know about its surroundings."""

    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    host: str | None = None
    port: int = 0
    #: The address every endpoint is advertised at (request plane, KV events and replay,
    #: load, KV transfer), whatever the bind address; None: see ``advertised_hosts``.
    advertise_host: str | None = None
    #: Seconds a shutting-down process waits for in-flight requests before closing.
    graceful_timeout: float = 30.0
    #: Seconds between withdrawing (clients stop routing here) and refusing new requests, so
    #: requests already on the wire are still served.
    grace_period: float = 0.5
    #: Health canaries of endpoints served with a ``health_check_payload``.
    canary: CanaryConfig = field(default_factory=CanaryConfig)
    #: Seconds a handler whose request was killed (or whose caller dropped its stream) has to
    #: see ``is_stopped()`` / ``is_killed()`` and return before it is cancelled where it waits.
    kill_grace: float = KILL_GRACE
    #: Key directory turning CURVE on for every socket (None: auth off), and the keypair's name.
    auth_keys: str | None = None
    auth_key_name: str = DEFAULT_KEY_NAME

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidArgument(f"port {self.port} out of range")
        if self.advertise_host is not None:
            _check_advertise_host(self.advertise_host)
        if not self.kill_grace >= 0:
            raise InvalidArgument(f"kill_grace must be >= 0 seconds, got {self.kill_grace}")
        if self.auth_keys:  # a missing or bad key is a configuration error, said at once
            load_keypair(self.auth_keys, self.auth_key_name)
            authorized_keys(self.auth_keys)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> RuntimeConfig:
        port = environ.get("DYN_PORT", "0") or "0"
        if not port.isdigit():
            raise InvalidArgument(f"DYN_PORT must be a number, got {port!r}")
        return cls(
            discovery=DiscoveryConfig.from_env(environ),
            host=environ.get("DYN_HOST") or None,
            port=int(port),
            advertise_host=environ.get("DYN_ADVERTISE_HOST") or None,
            canary=CanaryConfig.from_env(environ),
            auth_keys=environ.get("DYN_AUTH_KEYS") or None,
            auth_key_name=environ.get("DYN_AUTH_KEY_NAME") or DEFAULT_KEY_NAME,
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RuntimeConfig:
        return cls(
            discovery=DiscoveryConfig.from_args(args),
            host=getattr(args, "host", None) or None,
            port=int(getattr(args, "port", 0) or 0),
            advertise_host=getattr(args, "advertise_host", None) or None,
            canary=CanaryConfig.from_env(),
            **auth_from_args(args),
        )

    @property
    def bind_host(self) -> str:
        if self.host:
            return self.host
        if self.discovery.mdns_interfaces:
            return self.discovery.mdns_interfaces[0]
        return "0.0.0.0"

    def advertised_hosts(self) -> tuple[str, ...]:
        """Addresses peers should connect to: ``advertise_host`` if set; else the bind host;
        for a wildcard bind the pinned mDNS interfaces, else this machine's interface addresses
        (loopback only if it has no other).

        Read from the interfaces, not from the host name: in a network namespace, or where
        ``/etc/hosts`` maps the name to 127.0.x.x, the name says nothing another host can dial.
        Endpoints other than the request plane are advertised at the first of them; a peer
        that reached the request plane at another one dials them there (``endpoint_via``).
        """
        if self.advertise_host:
            return (self.advertise_host,)
        host = self.bind_host
        if host not in ("0.0.0.0", "*"):
            return (host,)
        if self.discovery.mdns_interfaces:
            return tuple(self.discovery.mdns_interfaces)
        return tuple(reachable_ipv4()) or ("127.0.0.1",)


def add_runtime_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--host``, ``--port`` and the discovery flags, defaulting to ``DYN_*`` variables."""
    parser.add_argument(
        "--host", default=os.environ.get("DYN_HOST"), help="bind address [DYN_HOST]"
    )
    parser.add_argument(
        "--port", type=int, default=os.environ.get("DYN_PORT") or "0",
        help="bind port, 0 = any [DYN_PORT]",
    )
    parser.add_argument(
        "--advertise-host", default=os.environ.get("DYN_ADVERTISE_HOST") or None,
        metavar="IP",
        help="the IPv4 address every endpoint of this process is advertised at (request "
             "plane, KV events and replay, load, KV transfer), whatever --host binds "
             "[DYN_ADVERTISE_HOST; default: the bind address, or every interface's]",
    )
    add_discovery_args(parser)
    add_auth_args(parser)


def _check_advertise_host(host: str) -> None:
    try:
        ip = ipaddress.IPv4Address(host)
    except ValueError:
        raise InvalidArgument(
            f"--advertise-host (DYN_ADVERTISE_HOST) must be an IPv4 address, got {host!r}"
        ) from None
    if ip.is_unspecified or ip.is_multicast:
        raise InvalidArgument(
            f"--advertise-host (DYN_ADVERTISE_HOST) must be an address peers can dial, not {host}"
        )


def add_auth_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--auth-keys`` and ``--auth-key-name`` (defaults: ``DYN_AUTH_KEYS``,
    ``DYN_AUTH_KEY_NAME``)."""
    group = parser.add_argument_group("auth")
    group.add_argument(
        "--auth-keys", default=os.environ.get("DYN_AUTH_KEYS") or None, metavar="DIR",
        help="key directory: CURVE on every socket, peers checked against DIR/authorized "
             "(python -m dynamo_zmq.keys) [DYN_AUTH_KEYS; default off]",
    )
    group.add_argument(
        "--auth-key-name", default=os.environ.get("DYN_AUTH_KEY_NAME") or DEFAULT_KEY_NAME,
        metavar="NAME", help="this process's keypair in DIR [DYN_AUTH_KEY_NAME; default "
                             "%(default)s]",
    )


def auth_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The ``RuntimeConfig`` auth fields from flags of ``add_auth_args`` (absent: off)."""
    return {
        "auth_keys": getattr(args, "auth_keys", None) or None,
        "auth_key_name": getattr(args, "auth_key_name", None) or DEFAULT_KEY_NAME,
    }

