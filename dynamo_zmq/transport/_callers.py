"""Who calls a request-plane server, with auth on: each connection's CURVE key, and what that
key may call.

Every message a CURVE ROUTER receives carries its connection's properties: the key the ZAP
handler accepted and the connection's file descriptor (``AsyncSocket.sender``). ``Callers``
notes them once per connection (a ROUTER identity), answers whether a REQUEST may go to an
endpoint (the key must hold a role the endpoint admits), and finds the connections of keys
that lost a role, to close them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Container

from ._connections import Connection, of_fd, shut_down
from ._curve import CurveAuth
from ._key_roles import DEFAULT_CALLERS, format_roles

__all__ = ["Callers"]

log = logging.getLogger("dynamo_zmq.transport.server")

#: Refused (key, endpoint) pairs logged by name; past this many, refusals are only counted.
MAX_LOGGED_DENIALS = 64


class Callers:
    """The callers of one server, by ROUTER identity.

    Args:
        curve: the process's CURVE keys.
        admitted: maps an endpoint path to the roles that may call it.
    """

    def __init__(
        self, curve: CurveAuth, admitted: Callable[[str], frozenset[str]] | None = None
    ) -> None:
        self.curve = curve
        self._admitted = admitted or (lambda _path: DEFAULT_CALLERS)
        self._by_identity: dict[bytes, tuple[str, Connection | None]] = {}
        self._logged: set[tuple[str, str]] = set()
        #: Requests refused for the caller's key roles.
        self.denials = 0

    def note(self, identity: bytes, sender: tuple[str, int] | None) -> None:
        """The message just received from ``identity`` came with ``sender`` (key, fd)."""
        if sender is not None and identity not in self._by_identity:
            self._by_identity[identity] = (sender[0], of_fd(sender[1]))

    def prune(self, active: Container[bytes]) -> None:
        """Forget the callers not ``active`` whose connection is gone. (A silent caller's
        connection may still be open: its key is kept, so a revoke can close it.)"""
        for identity, (_, conn) in list(self._by_identity.items()):
            if identity not in active and (conn is None or of_fd(conn.fd) != conn):
                del self._by_identity[identity]

    def deny(self, identity: bytes, endpoint: str) -> str | None:
        """Why the caller behind ``identity`` may not call ``endpoint`` (None: it may)."""
        key = self._by_identity.get(identity, ("", None))[0]
        roles = self.curve.roles_of(key)
        admitted = self._admitted(endpoint)
        if roles & admitted:
            return None
        self.denials += 1
        name = self.curve.name_of(key) if key else "?"
        why = (f"key {name} ({format_roles(roles)}) may not call {endpoint}: it admits "
               f"{format_roles(admitted)}")
        if (key, endpoint) not in self._logged and len(self._logged) < MAX_LOGGED_DENIALS:
            self._logged.add((key, endpoint))
            log.warning("refused a request: %s", why)
        return why

    def of_keys(self, keys: frozenset[bytes]) -> list[bytes]:
        """The identities whose key is one of ``keys``."""
        return [ident for ident, (key, _) in self._by_identity.items() if key.encode() in keys]

    def close(self, identity: bytes) -> None:
        """End ``identity``'s connection: its key lost a role."""
        key, conn = self._by_identity.pop(identity, ("", None))
        closed = conn is not None and shut_down(conn)
        log.warning("key %s lost a role: %s its connection from %s",
                    self.curve.name_of(key), "closed" if closed else "could not close",
                    f"{conn.peer[0]}:{conn.peer[1]}" if conn else "an unknown address")

    def follow(self, gone: Callable[[bytes], None]) -> Callable[[], None]:
        """When keys lose a role, close their connections and call ``gone(identity)`` for each
        (the server kills its streams), on the running loop; returns the call that stops it."""
        loop = asyncio.get_running_loop()

        def drop(keys: frozenset[bytes]) -> None:
            for identity in self.of_keys(keys):
                self.close(identity)
                gone(identity)

        def lost(keys: frozenset[bytes]) -> None:  # from the thread that saw the change
            if not loop.is_closed():
                loop.call_soon_threadsafe(drop, keys)

        self.curve.add_listener(lost)
        return lambda: self.curve.remove_listener(lost)
