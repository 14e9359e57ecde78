"""Watches what the network says about this process's own mDNS services.

An advert's service name carries its instance id, the runtime's lease id, so it is the
registration the lease keeps. Two things can happen to it out there: another responder claims
the name with a different target (a conflict: RFC 6762 says the name must change, and a new
name is a new instance, so the registration is lost for good), or a goodbye for it arrives that
this process did not send (browsers dropped it; announcing again brings it back). The guard only
notes both; ``MdnsDiscovery.renew`` acts on them.
"""

from __future__ import annotations

from zeroconf import RecordUpdate, RecordUpdateListener, Zeroconf
from zeroconf._dns import DNSService

__all__ = ["AdvertGuard"]

_TYPE_SRV = 33


class AdvertGuard(RecordUpdateListener):
    """A zeroconf record listener for the SRV records of this process's own services."""

    def __init__(self) -> None:
        #: lower-case service name -> (lower-case target host, port) this process publishes
        self._ours: dict[str, tuple[str, int]] = {}
        self._conflicts: dict[str, str] = {}
        self._removed: set[str] = set()

    def claim(self, name: str, server: str, port: int) -> None:
        """Start watching ``name``, published with target ``server:port``."""
        key = name.lower()
        self._ours[key] = (server.lower(), port)
        self._removed.discard(key)

    def release(self, name: str) -> None:
        """Stop watching ``name`` (withdrawn: its goodbyes are ours)."""
        key = name.lower()
        self._ours.pop(key, None)
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

    def async_update_records_complete(self) -> None:
        """Nothing to do once a packet's records are in the cache."""
