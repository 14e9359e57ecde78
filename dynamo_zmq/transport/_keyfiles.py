"""CURVE key files: this process's keypair and the public keys it trusts.

A key directory holds::

    DIR/NAME.key          the public key (ZeroMQ certificate format, shareable)
    DIR/NAME.key_secret   the secret key (mode 0600; refused when others can read it)
    DIR/authorized/*.key  public keys of the peers this process accepts, one file each

The files are ZeroMQ's certificate format (``zmq.auth.load_certificate`` reads them). An
authorized key's file may name its roles in the certificate's ``metadata`` section
(``role = "worker,frontend"``, ``_key_roles.py``); one without (authorized before roles, or
without ``--role``) holds every role. The command line over these functions is
``python -m dynamo_zmq.keys`` (``tools/keys.py``).
"""

from __future__ import annotations

import datetime
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85

from .. import errors
from ._key_roles import EVERY_ROLE, format_roles, parse_roles

__all__ = [
    "AUTHORIZED",
    "DEFAULT_NAME",
    "KeyFileError",
    "TrustedKey",
    "authorize",
    "authorized_keys",
    "create_keypair",
    "load_keypair",
    "parse_public_key",
    "revoke",
    "trusted_keys",
]

DEFAULT_NAME = "node"
AUTHORIZED = "authorized"
_Z85_LEN = 40  # a 32-byte CURVE key in Z85 text


class KeyFileError(errors.InvalidArgument):
    """A key file that is missing, unreadable, malformed or too widely readable."""


@dataclass(frozen=True)
class TrustedKey:
    """One authorized public key and its roles."""

    public: bytes
    roles: frozenset[str]
    #: Whether its file names the roles (False: authorized without a role, so every role).
    explicit: bool


def parse_public_key(text: str | bytes) -> bytes:
    """A CURVE public key from its Z85 text (40 characters).

    Raises:
        KeyFileError: anything else.
    """
    raw = text.strip() if isinstance(text, bytes) else text.strip().encode("ascii", "replace")
    try:
        valid = len(raw) == _Z85_LEN and len(z85.decode(raw)) == 32
    except (ValueError, KeyError, TypeError, struct.error):
        valid = False
    if not valid:
        shown = raw[:60].decode("ascii", "replace")
        raise KeyFileError(f"{shown!r} is not a CURVE public key (40 characters of Z85 text)")
    return raw


def _write(
    path: Path, public: bytes, secret: bytes | None, roles: frozenset[str] | None = None
) -> None:
    kind = "Secret" if secret is not None else "Public"
    lines = [
        f"#   ****  Generated on {datetime.datetime.now():%Y-%m-%d %H:%M:%S} by dynamo-zmq  ****",
        f"#   ZeroMQ CURVE {kind} Certificate",
    ]
    if secret is not None:
        lines.append("#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.")
    lines += ["", "metadata"]
    if roles is not None:
        lines.append(f'    role = "{format_roles(roles)}"')
    lines += ["curve", f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    mode = 0o600 if secret is not None else 0o644
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write("\n".join(lines) + "\n")


def _read(path: Path) -> tuple[bytes, bytes | None]:
    """(public, secret or None) of a certificate file, checked."""
    public, secret, _ = _read_all(path)
    return public, secret


def _read_all(path: Path) -> tuple[bytes, bytes | None, frozenset[str] | None]:
    """(public, secret or None, roles or None) of a certificate file, checked."""
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise KeyFileError(f"no key file at {path}") from None
    except OSError as exc:
        raise KeyFileError(f"cannot read key file {path}: {exc.strerror or exc}") from None
    found: dict[bytes, bytes] = {}
    for line in text.splitlines():
        line = line.strip()
        for field in (b"public-key", b"secret-key", b"role"):
            if line.split(b"=", 1)[0].strip() == field and b"=" in line:
                found[field] = line.split(b"=", 1)[1].strip(b" \t'\"")
    if b"public-key" not in found:
        raise KeyFileError(f"{path} is not a CURVE key file (no public-key line)")
    public = _checked(found[b"public-key"], path, "public")
    secret = found.get(b"secret-key")
    roles = None
    if b"role" in found:
        try:
            roles = parse_roles(found[b"role"].decode("ascii", "replace"))
        except errors.InvalidArgument as exc:
            raise KeyFileError(f"{path}: {exc.message}") from None
    return public, None if secret is None else _checked(secret, path, "secret"), roles


def _checked(key: bytes, path: Path, which: str) -> bytes:
    try:
        return parse_public_key(key)
    except KeyFileError:
        raise KeyFileError(f"{path} holds a malformed {which} key") from None


def create_keypair(key_dir: str | Path, name: str = DEFAULT_NAME) -> bytes:
    """Make ``NAME.key`` and ``NAME.key_secret`` in ``key_dir`` (created, mode 0700, if
    missing) and return the public key; never overwrites a key.

    Raises:
        KeyFileError: a key of that name exists, or the directory cannot be written.
    """
    root = Path(key_dir)
    public, secret = zmq.curve_keypair()
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        (root / AUTHORIZED).mkdir(mode=0o700, exist_ok=True)
        _write(root / f"{name}.key_secret", public, secret)
        _write(root / f"{name}.key", public, None)
    except FileExistsError as exc:
        raise KeyFileError(f"a key already exists at {exc.filename}: not overwritten") from None
    except OSError as exc:
        raise KeyFileError(f"cannot write keys in {root}: {exc.strerror or exc}") from None
    return public


def load_keypair(key_dir: str | Path, name: str = DEFAULT_NAME) -> tuple[bytes, bytes]:
    """(public, secret) of ``NAME`` in ``key_dir``.

    Raises:
        KeyFileError: the secret key file is missing, unreadable, malformed, holds no secret
            key, or is readable by others than its owner (as ssh refuses such a key).
    """
    path = Path(key_dir) / f"{name}.key_secret"
    public, secret = _read(path)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise KeyFileError(
            f"{path} is readable by others (mode {mode:04o}): run chmod 600 {path}"
        )
    if secret is None:
        raise KeyFileError(f"{path} holds no secret key")
    return public, secret


def authorized_keys(key_dir: str | Path) -> dict[str, bytes]:
    """The trusted public keys of ``key_dir``, by name (an empty dict if there are none).

    Raises:
        KeyFileError: a file there is unreadable or malformed (one bad file is an error, never
            skipped: a typo must not silently lock a peer out or in).
    """
    return {name: trusted.public for name, trusted in trusted_keys(key_dir).items()}


def trusted_keys(key_dir: str | Path) -> dict[str, TrustedKey]:
    """The trusted public keys of ``key_dir`` and their roles, by name.

    Raises:
        KeyFileError: a file there is unreadable, malformed or names an unknown role.
    """
    folder = Path(key_dir) / AUTHORIZED
    if not folder.is_dir():
        return {}
    found = {}
    for path in sorted(folder.glob("*.key")):
        public, _, roles = _read_all(path)
        found[path.stem] = TrustedKey(public, roles or EVERY_ROLE, roles is not None)
    return found


def authorize(
    key_dir: str | Path, key: str, name: str | None = None,
    roles: frozenset[str] | None = None,
) -> str:
    """Trust ``key`` (Z85 text, or the path of a ``.key`` file) under ``name`` (default: the
    file's stem, else the key's first 8 characters) with ``roles`` (None: every role, or the
    roles it already has); returns the name. A key already trusted under that name gets
    ``roles`` (the file is replaced atomically).

    Raises:
        KeyFileError: a malformed key, or another key already trusted under that name.
    """
    path = Path(key)
    if path.suffix == ".key" or path.is_file():
        public, _ = _read(path)
        name = name or path.stem
    else:
        public = parse_public_key(key)
    name = name or public[:8].decode()
    if not name.replace("-", "").replace("_", "").isalnum():
        raise KeyFileError(f"key name {name!r}: use letters, digits, '-' and '_' only")
    folder = Path(key_dir) / AUTHORIZED
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    target = folder / f"{name}.key"
    if target.exists():
        current, _, had = _read_all(target)
        if current != public:
            raise KeyFileError(f"another key is already authorized as {name!r} ({target})")
        if roles is None or roles == had:
            return name
        staged = folder / f".{name}.key.new"
        staged.unlink(missing_ok=True)
        _write(staged, public, None, roles)
        os.replace(staged, target)  # readers see the old file or the new one, never half
        return name
    _write(target, public, None, roles)
    return name


def revoke(key_dir: str | Path, name_or_key: str) -> list[str]:
    """Stop trusting the key named ``name_or_key``, or every file holding that key; returns
    the names removed (empty: nothing matched)."""
    removed = []
    for name, public in authorized_keys(key_dir).items():
        if name_or_key in (name, public.decode()):
            (Path(key_dir) / AUTHORIZED / f"{name}.key").unlink()
            removed.append(name)
    return removed
