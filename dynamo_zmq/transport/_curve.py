"""CURVE on every socket ``make_socket`` makes: off unless ``enable_curve`` is called.

Once enabled (``--auth-keys DIR``), the process has one keypair (``DIR/NAME.key_secret``) and
one ZAP handler on its ZMQ context. Bound sockets are CURVE servers: the ZAP handler accepts a
client only if its public key is in ``DIR/authorized`` (re-read when the folder changes, so
keys are added and revoked without restarts; a revoked key is refused for new connections).
Connecting sockets are CURVE clients: they need the server's public key (from discovery, or
learned from the described connection of the same instance) and refuse to connect unless that
key is authorized too. CURVE costs per connection (handshake, one ZAP call) and per message
(libzmq encrypts and authenticates every frame on its I/O thread), nothing on our event loop.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from .. import errors
from ._keyfiles import AUTHORIZED, KeyFileError, authorized_keys, load_keypair

__all__ = [
    "CurveAuth",
    "CurveRefused",
    "current_curve",
    "disable_curve",
    "enable_curve",
    "peer_key",
]

log = logging.getLogger(__name__)

#: Seconds between looks at the authorized folder (each handshake may look; a flood of them
#: must not turn into a flood of directory listings).
RECHECK_INTERVAL = 0.2
#: Distinct refused keys logged by name; beyond that, refusals are only counted.
MAX_LOGGED_REFUSALS = 64

_Stamp = tuple[tuple[str, int, int, int], ...]


class CurveRefused(errors.CannotConnect):
    """A peer's public key is unknown or not in the authorized set: no connection is made."""


class CurveAuth:
    """This process's keypair and its live authorized set.

    Raises (constructor):
        KeyFileError: the keypair cannot be loaded or an authorized key file is malformed.
    """

    def __init__(self, key_dir: str | Path, name: str) -> None:
        self.key_dir = Path(key_dir)
        self.name = name
        self.public, self.secret = load_keypair(self.key_dir, name)
        self._lock = threading.Lock()
        self._stamp = self._folder_stamp()
        self._keys = frozenset(authorized_keys(self.key_dir).values())
        self._checked_at = time.monotonic()
        self._refused: set[bytes] = set()
        #: Connections refused by the ZAP handler (any key not authorized).
        self.refusals = 0
        #: Server keys of instances whose connection completed the CURVE handshake, by id.
        self._peer_keys: dict[int, bytes] = {}
        self._authenticator: ThreadAuthenticator | None = None

    # -- the authorized set ----------------------------------------------------------------

    def is_authorized(self, key: bytes) -> bool:
        """Whether ``key`` (Z85) is in the authorized set as it is on disk now."""
        self._refresh()
        return key in self._keys

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
        with self._lock:
            now = time.monotonic()
            if now - self._checked_at < RECHECK_INTERVAL:
                return
            self._checked_at = now
            stamp = self._folder_stamp()
            if stamp == self._stamp:
                return
            try:
                keys = frozenset(authorized_keys(self.key_dir).values())
            except KeyFileError as exc:  # e.g. a file being written: keep the set, look again
                log.warning("authorized keys unchanged: %s", exc.message)
                return
            self._stamp = stamp
            added, removed = len(keys - self._keys), len(self._keys - keys)
            self._keys = keys
            self._refused -= keys
            log.info("authorized keys reloaded from %s: %d (+%d, -%d)",
                     self.key_dir / AUTHORIZED, len(keys), added, removed)

    # -- the ZAP handler -------------------------------------------------------------------

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's credentials-provider hook: is this client's key (Z85) authorized?"""
        if self.is_authorized(key):
            return True
        self.refusals += 1
        if key not in self._refused and len(self._refused) < MAX_LOGGED_REFUSALS:
            self._refused.add(key)
            log.warning("refused a connection from unauthorized key %s", key.decode())
        return False

    def start(self, zctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        """Run the ZAP handler on ``zctx`` (a thread; before any CURVE server binds)."""
        auth = ThreadAuthenticator(zctx, log=logging.getLogger(__name__ + ".zap"))
        auth.start()
        auth.configure_curve_callback("*", credentials_provider=self)
        self._authenticator = auth

    def stop(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None

    # -- sockets ---------------------------------------------------------------------------

    def make_server(self, sock: zmq.Socket[bytes]) -> None:
        """Make ``sock`` (not yet bound) a CURVE server with this process's keypair."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

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
             len(auth._keys))
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
