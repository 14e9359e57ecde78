"""CURVE on every socket ``make_socket`` makes: off unless ``enable_curve`` is called.

Once enabled (``--auth-keys DIR``), the process has one keypair (``DIR/NAME.key_secret``) and
one ZAP handler on its ZMQ context. Bound sockets are CURVE servers: the ZAP handler accepts a
client only if its public key is in ``DIR/authorized`` with a role the socket's kind admits
(``_key_roles.py``: each bound socket names its kind as its ZAP domain). Connecting sockets
are CURVE clients: they need the server's public key (from discovery, or learned from the
described connection of the same instance) and refuse to connect unless that key is
authorized too. CURVE costs per connection (handshake, one ZAP call) and per message (libzmq
encrypts and authenticates every frame on its I/O thread), nothing on our event loop.

A thread re-reads the authorized folder when it changes (every ``RECHECK_INTERVAL``), so keys
are added, revoked and given other roles without restarts. When a key loses a role (revoked:
all of them), its open connections are closed within a second: the request plane's
``Server`` ends the revoked caller's connections exactly (it knows each caller's key), and
every other bound socket ends the connections from the addresses that key connected from
(``_connections.py``; another key's connection from the same address reconnects at once).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from .. import errors
from ._connections import established, shut_down_all
from ._key_roles import ADMITTED, EVERY_ROLE, Domain, format_roles
from ._keyfiles import AUTHORIZED, KeyFileError, TrustedKey, load_keypair, trusted_keys

__all__ = [
    "CurveAuth",
    "CurveRefused",
    "current_curve",
    "disable_curve",
    "enable_curve",
    "peer_key",
    "peer_roles",
    "warn_unless_own_role",
]

log = logging.getLogger(__name__)

#: Seconds between looks at the authorized folder (each handshake may look too; a flood of
#: them must not turn into a flood of directory listings).
RECHECK_INTERVAL = 0.2
#: Distinct refused keys logged by name; beyond that, refusals are only counted.
MAX_LOGGED_REFUSALS = 64
#: Peer addresses remembered per key (where a revoke looks for its connections).
MAX_ADDRESSES = 64

_Stamp = tuple[tuple[str, int, int, int], ...]
#: Called with the keys that lost a role (from whichever thread saw the change).
TrustListener = Callable[[frozenset[bytes]], None]


class CurveRefused(errors.CannotConnect):
    """A peer's public key is unknown or not in the authorized set: no connection is made."""


class _Zap(ThreadAuthenticator):
    """pyzmq's ZAP thread, keeping the peer address of the request it is answering (the
    credentials callback is not given it). Requests are answered one at a time."""

    address = ""

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self.address = msg[3].decode("ascii", "replace") if len(msg) > 3 else ""
        await super().handle_zap_message(msg)


class CurveAuth:
    """This process's keypair and its live authorized set, with each key's roles.

    Raises (constructor):
        KeyFileError: the keypair cannot be loaded or an authorized key file is malformed.
    """

    def __init__(self, key_dir: str | Path, name: str) -> None:
        self.key_dir = Path(key_dir)
        self.name = name
        self.public, self.secret = load_keypair(self.key_dir, name)
        self._lock = threading.Lock()
        self._stamp = self._folder_stamp()
        self._roles: dict[bytes, frozenset[str]] = {}
        self._names: dict[bytes, str] = {}
        self._every_role_noted: set[str] = set()
        self._index(trusted_keys(self.key_dir))
        #: Bumped by every change of the authorized set or of a key's roles.
        self.generation = 0
        self._checked_at = time.monotonic()
        self._refused: set[tuple[bytes, str]] = set()
        #: Connections refused by the ZAP handler (a key not authorized, or not for that socket).
        self.refusals = 0
        #: Server keys of instances whose connection completed the CURVE handshake, by id.
        self._peer_keys: dict[int, bytes] = {}
        #: Addresses each key connected from (ZAP), and the bound sockets' ports by ZAP domain.
        self._addresses: dict[bytes, set[str]] = {}
        self._bound: dict[int, str] = {}
        self._listeners: list[TrustListener] = []
        self._authenticator: _Zap | None = None
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    # -- the authorized set ----------------------------------------------------------------

    def is_authorized(self, key: bytes) -> bool:
        """Whether ``key`` (Z85) is in the authorized set as it is on disk now."""
        return bool(self.roles_of(key))

    def roles_of(self, key: bytes | str | None) -> frozenset[str]:
        """The roles ``key`` (Z85) holds now; empty when it is not authorized."""
        self._refresh()
        if isinstance(key, str):
            key = key.encode()
        return self._roles.get(key, frozenset()) if key else frozenset()

    def name_of(self, key: bytes | str) -> str:
        """The name ``key`` is authorized under, else its first 8 characters."""
        raw = key.encode() if isinstance(key, str) else key
        return self._names.get(raw) or raw[:8].decode("ascii", "replace")

    def own_roles(self) -> frozenset[str] | None:
        """The roles this process's own key holds here (None: it is not in its own
        authorized set, so this process cannot tell what its peers grant it)."""
        return self.roles_of(self.public) or None

    @property
    def authorized_count(self) -> int:
        return len(self._roles)

    def _index(self, trusted: dict[str, TrustedKey]) -> None:
        self._roles = {t.public: t.roles for t in trusted.values()}
        # Names of revoked keys are kept: the logs of what a revoke closes use them.
        self._names = {**self._names, **{t.public: name for name, t in trusted.items()}}
        every = sorted(name for name, t in trusted.items()
                       if not t.explicit and name not in self._every_role_noted)
        if every:
            self._every_role_noted.update(every)
            log.info("authorized keys without a role hold every role (worker, frontend, router, "
                     "tool): %s; python -m dynamo_zmq.keys authorize DIR KEY --role ROLE "
                     "restricts one", ", ".join(every))

    def _folder_stamp(self) -> _Stamp:
        folder = self.key_dir / AUTHORIZED
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            return ()
        stamp = []
        for entry in entries:
            if entry.name.endswith(".key"):
                try:
                    st = entry.stat()
                except OSError:
                    continue
                stamp.append((entry.name, st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(stamp)

    def _refresh(self) -> None:
        shrunk: dict[bytes, frozenset[str]] = {}
        with self._lock:
            now = time.monotonic()
            if now - self._checked_at < RECHECK_INTERVAL:
                return
            self._checked_at = now
            stamp = self._folder_stamp()
            if stamp == self._stamp:
                return
            try:
                trusted = trusted_keys(self.key_dir)
            except KeyFileError as exc:  # e.g. a file being written: keep the set, look again
                log.warning("authorized keys unchanged: %s", exc.message)
                return
            self._stamp = stamp
            before, names = self._roles, self._names
            self._index(trusted)
            self.generation += 1
            for key, roles in before.items():
                if not roles <= self._roles.get(key, frozenset()):
                    shrunk[key] = roles
            self._refused = {(k, d) for k, d in self._refused
                             if not (self._admits(k, d) if d else k in self._roles)}
            log.info("authorized keys reloaded from %s: %d (+%d, -%d)",
                     self.key_dir / AUTHORIZED, len(self._roles),
                     len(self._roles.keys() - before.keys()),
                     len(before.keys() - self._roles.keys()))
        if shrunk:
            for key, had in shrunk.items():
                now_roles = self._roles.get(key)
                log.warning("key %s (%s) %s: closing its connections",
                            names.get(key, key[:8].decode()), format_roles(had),
                            f"now holds {format_roles(now_roles)}" if now_roles else "revoked")
            self._on_shrunk(frozenset(shrunk))

    def _on_shrunk(self, keys: frozenset[bytes]) -> None:
        """Close what ``keys`` have open (they lost a role): every bound socket but the
        request plane's by address here, the request plane's by its listeners."""
        with self._lock:
            addresses = {a for k in keys for a in self._addresses.get(k, ())}
            ports = {p for p, domain in self._bound.items() if domain != Domain.REQUEST}
        if addresses and ports:
            ended = shut_down_all(established(ports, addresses))
            if ended:
                log.info("closed %d connections from %s to KV-event, load, replica and KV "
                         "transfer sockets", ended, ", ".join(sorted(addresses)))
        for listener in list(self._listeners):
            try:
                listener(keys)
            except Exception:
                log.exception("a listener of key changes failed")

    def add_listener(self, listener: TrustListener) -> None:
        """Call ``listener(keys)`` when keys lose a role (revoked, or given fewer roles); it is
        called from the thread that saw the change and must hand over to its own."""
        self._listeners.append(listener)

    def remove_listener(self, listener: TrustListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def _watch(self) -> None:
        while not self._stop.wait(RECHECK_INTERVAL):
            try:
                self._refresh()
            except Exception:
                log.exception("looking at the authorized keys failed")

    # -- the ZAP handler -------------------------------------------------------------------

    def _admits(self, key: bytes, domain: str) -> bool:
        return bool(self._roles.get(key, frozenset()) & ADMITTED.get(domain, EVERY_ROLE))

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's credentials-provider hook: may this client's key (Z85) connect to a socket
        of ``domain``?"""
        roles = self.roles_of(key)
        if roles & ADMITTED.get(domain, EVERY_ROLE):
            address = self._authenticator.address if self._authenticator is not None else ""
            with self._lock:
                seen = self._addresses.setdefault(key, set())
                if address and len(seen) < MAX_ADDRESSES:
                    seen.add(address)
            return True
        self.refusals += 1
        said = (key, domain if roles else "")  # an unknown key is said once, not per socket
        if said not in self._refused and len(self._refused) < MAX_LOGGED_REFUSALS:
            self._refused.add(said)
            if not roles:
                log.warning("refused a connection from unauthorized key %s", key.decode())
            else:
                log.warning("refused a connection from key %s (%s) to a %s socket: it admits %s",
                            self.name_of(key), format_roles(roles), domain,
                            format_roles(ADMITTED[domain]))
        return False

    def start(self, zctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        """Run the ZAP handler on ``zctx`` (a thread; before any CURVE server binds) and the
        thread that follows the authorized folder."""
        auth = _Zap(zctx, log=logging.getLogger(__name__ + ".zap"))
        auth.start()
        for domain in ("*", *ADMITTED):
            auth.configure_curve_callback(domain, credentials_provider=self)
        self._authenticator = auth
        self._stop.clear()
        self._watcher = threading.Thread(target=self._watch, name="dynamo-authorized-keys",
                                         daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(5)
            self._watcher = None
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None

    # -- sockets ---------------------------------------------------------------------------

    def make_server(self, sock: zmq.Socket[bytes], domain: str | None = None) -> None:
        """Make ``sock`` (not yet bound) a CURVE server with this process's keypair, admitting
        the roles of ``domain`` (a ``Domain``; None: every role)."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True
        if domain is not None:
            sock.zap_domain = domain.encode()

    def note_bound(self, port: int, domain: str | None) -> None:
        """A CURVE server socket of ``domain`` listens on ``port``: a revoke closes its
        connections of the revoked key (``domain`` None: as every role's socket)."""
        with self._lock:
            self._bound[port] = domain or "*"

    def make_client(self, sock: zmq.Socket[bytes], server_key: bytes | None, what: str) -> None:
        """Make ``sock`` (not yet connected) a CURVE client of ``server_key``.

        Raises:
            CurveRefused: no server key is known, or it is not authorized.
        """
        prefix = f"{what}: " if what else ""
        if server_key is None:
            raise CurveRefused(f"{prefix}no public key is known for it (auth is on)")
        if not self.is_authorized(server_key):
            raise CurveRefused(f"{prefix}its key {server_key.decode()} is not authorized")
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = server_key

    def remember(self, instance_id: int, server_key: bytes) -> None:
        """Record the key an instance's request plane proved (its other sockets use it too)."""
        self._peer_keys[instance_id] = server_key

    def peer_key(self, instance_id: int) -> bytes | None:
        return self._peer_keys.get(instance_id)


_current: CurveAuth | None = None


def enable_curve(
    key_dir: str | Path, name: str, zctx: zmq.Context[zmq.Socket[bytes]]
) -> CurveAuth:
    """Turn CURVE on for every socket this process makes from now on (idempotent for the same
    keys).

    Raises:
        KeyFileError: the keys cannot be loaded.
        InvalidArgument: CURVE is already on with other keys.
    """
    global _current
    if _current is not None:
        if _current.key_dir == Path(key_dir) and _current.name == name:
            return _current
        raise errors.InvalidArgument("CURVE is already enabled with other keys")
    if not zmq.has("curve"):
        raise errors.Unsupported("this libzmq was built without CURVE")
    auth = CurveAuth(key_dir, name)
    auth.start(zctx)
    _current = auth
    log.info("CURVE on: public key %s, %d authorized keys", auth.public.decode(),
             auth.authorized_count)
    return auth


def disable_curve() -> None:
    """Turn CURVE off again (tests); sockets made meanwhile keep their settings."""
    global _current
    if _current is not None:
        _current.stop()
        _current = None


def current_curve() -> CurveAuth | None:
    """The process's ``CurveAuth``, or None when auth is off."""
    return _current


def peer_key(instance_id: int) -> bytes | None:
    """The CURVE key of ``instance_id`` learned from its request plane (None: auth off or
    unknown). Subscribers to an instance's KV events and load connect with it."""
    return _current.peer_key(instance_id) if _current is not None else None


def peer_roles(key: bytes | None) -> frozenset[str] | None:
    """The roles a peer's key (Z85) holds here now; None when auth is off (nothing is checked)
    and empty when the key is not authorized (or unknown)."""
    if _current is None:
        return None
    return _current.roles_of(key) if key else frozenset()


def warn_unless_own_role(role: str, what: str) -> None:
    """Say so when this process's own key is authorized here without ``role``: its peers
    (sharing this authorized set) refuse it as that (``what`` they would do with it)."""
    if _current is None or (own := _current.own_roles()) is None or role in own:
        return
    log.warning("this process's key %s is not authorized as a %s here (it holds %s): %s",
                _current.name, role, format_roles(own), what)
