"""Watches what the network says about this process's own mDNS services.

An advert's service name carries its instance id. Two things can happen to it out there:
another responder claims the name (a conflict: its SRV record names another target or port, or
an address record gives the advert's host name an address that is not ours; a stray or cloned
responder is enough), or a goodbye for it arrives that this process did not send (browsers
dropped it; announcing again brings it back). The guard only notes both; ``MdnsDiscovery.renew``
acts on them: a claimed name is given up for a new one (RFC 6762, section 9), the instance
stays what it is (its id travels in the TXT record, and liveness is the sockets').
"""

from __future__ import annotations

import socket

from zeroconf import RecordUpdate, RecordUpdateListener, Zeroconf
from zeroconf._dns import DNSAddress, DNSService

__all__ = ["AdvertGuard"]

_TYPE_A = 1
_TYPE_SRV = 33


class AdvertGuard(RecordUpdateListener):
    """A zeroconf record listener for the SRV records of this process's own services."""

    def __init__(self) -> None:
        #: lower-case service name -> (lower-case target host, port) this process publishes
        self._ours: dict[str, tuple[str, int]] = {}
        #: lower-case target host -> (its service's name, the IPv4 addresses we publish for it)
        self._hosts: dict[str, tuple[str, frozenset[str]]] = {}
        self._conflicts: dict[str, str] = {}
        self._removed: set[str] = set()

    def claim(self, name: str, server: str, port: int, addresses: list[str]) -> None:
        """Start watching ``name``, published with target ``server:port`` at ``addresses``."""
        key = name.lower()
        self._ours[key] = (server.lower(), port)
        self._hosts[server.lower()] = (key, frozenset(addresses))
        self._removed.discard(key)

    def release(self, name: str) -> None:
        """Stop watching ``name`` (withdrawn: its goodbyes are ours)."""
        key = name.lower()
        ours = self._ours.pop(key, None)
        if ours is not None:
            self._hosts.pop(ours[0], None)
        self._conflicts.pop(key, None)
        self._removed.discard(key)

    def conflict(self, name: str) -> str | None:
        """Why ``name`` is lost to another responder, or ``None``."""
        return self._conflicts.get(name.lower())

    def take_removed(self, name: str) -> bool:
        """Whether a goodbye for ``name`` arrived since the last call (and forget it)."""
        key = name.lower()
        if key in self._removed:
            self._removed.discard(key)
            return True
        return False

    def async_update_records(self, zc: Zeroconf, now: float, records: list[RecordUpdate]) -> None:
        for update in records:
            record = update.new
            if record.type == _TYPE_A and isinstance(record, DNSAddress):
                self._check_address(record)
                continue
            if record.type != _TYPE_SRV or not isinstance(record, DNSService):
                continue
            ours = self._ours.get(record.key)
            if ours is None:
                continue
            if (record.server_key, record.port) != ours:
                if record.ttl and record.key not in self._conflicts:
                    self._conflicts[record.key] = (
                        f"another responder claims {record.name} "
                        f"(target {record.server}:{record.port})"
                    )
            elif record.ttl == 0:
                self._removed.add(record.key)

    def _check_address(self, record: DNSAddress) -> None:
        """An address for one of our targets that is not ours claims the name (a clone)."""
        host = self._hosts.get(record.key)
        if host is None or not record.ttl or host[0] in self._conflicts:
            return
        try:
            address = socket.inet_ntoa(record.address)
        except (OSError, TypeError, ValueError):
            return
        if address not in host[1]:
            self._conflicts[host[0]] = (
                f"another responder claims {record.name} (address {address})"
            )

    def async_update_records_complete(self) -> None:
        """Nothing to do once a packet's records are in the cache."""
