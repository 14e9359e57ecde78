"""The frontend's HTTP security: API keys (``Authorization: Bearer`` or ``x-api-key``) and TLS.

API keys come from ``--api-key`` (repeatable), ``DYN_API_KEYS`` (comma-separated) and
``--api-key-file`` / ``DYN_API_KEY_FILE`` (one key per line, ``#`` comments), which is re-read
when it changes, so keys can be added or revoked without a restart. With no key configured the
frontend is open, as before. A key is sent as ``Authorization: Bearer KEY`` (OpenAI's clients) or
``x-api-key: KEY`` (Anthropic's); the two are equivalent (``request_api_key``: Authorization
first), here and for the tenant a key names. ``ApiKeyGuard`` answers 401 in OpenAI's error
shape (Anthropic's on the Messages API's routes) to any request without a configured key, except
on the exempt routes (``--api-key-exempt``, by default the health, liveness and metrics routes,
which probes and scrapers call).

TLS: ``--tls-cert-file`` and ``--tls-key-file`` (PEM) make the frontend serve HTTPS; both are
loaded up front, so a missing or mismatched file is one clear error at start.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import logging
import os
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import errors
from ._anthropic_errors import MESSAGES_ROUTES, anthropic_send
from ._asgi import Receive, Scope, Send, error, header
from .errors import HttpError

__all__ = [
    "ApiKeyGuard",
    "ApiKeys",
    "HttpSecurity",
    "TlsFiles",
    "add_http_security_args",
    "http_security",
    "is_loopback",
    "request_api_key",
]

log = logging.getLogger(__name__)

DEFAULT_EXEMPT = "/health,/live,/metrics"
#: How often, at most, the key file's modification stamp is checked.
_RECHECK_SECONDS = 1.0


def add_http_security_args(parser: argparse.ArgumentParser) -> None:
    """The frontend's API-key and TLS flags."""
    env = os.environ.get
    group = parser.add_argument_group("HTTP security")
    group.add_argument(
        "--api-key", action="append", default=[],
        help="a key clients must send as 'Authorization: Bearer KEY' or 'x-api-key: KEY' "
             "(repeat for several). No "
             "key configured: no check [DYN_API_KEYS: a comma-separated list, added to these]",
    )
    group.add_argument(
        "--api-key-file", default=env("DYN_API_KEY_FILE"),
        help="a file of keys, one per line (# comments), re-read when it changes "
             "[DYN_API_KEY_FILE]",
    )
    group.add_argument(
        "--api-key-exempt", default=env("DYN_API_KEY_EXEMPT", DEFAULT_EXEMPT),
        help="comma-separated routes served without a key (empty: none) "
             f"[DYN_API_KEY_EXEMPT, default {DEFAULT_EXEMPT}]",
    )
    group.add_argument("--tls-cert-file", default=env("DYN_TLS_CERT_FILE"),
                       help="PEM certificate (chain): serve HTTPS [DYN_TLS_CERT_FILE]")
    group.add_argument("--tls-key-file", default=env("DYN_TLS_KEY_FILE"),
                       help="PEM private key of --tls-cert-file [DYN_TLS_KEY_FILE]")


def _read_key_file(path: Path) -> list[str]:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise errors.InvalidArgument(f"cannot read the API key file {path}: {exc}") from None
    return [k for line in text.splitlines() if (k := line.split("#", 1)[0].strip())]


@dataclass
class ApiKeys:
    """The accepted keys: fixed ones plus the lines of a file that is re-read on change."""

    fixed: list[bytes]
    path: Path | None = None
    _from_file: list[bytes] = field(default_factory=list)
    _stamp: tuple[int, int] | None = None
    _checked: float = 0.0

    def __post_init__(self) -> None:
        if self.path is not None:
            self._reload(initial=True)

    @property
    def enabled(self) -> bool:
        """Whether any key is configured (a key file, even an empty one, counts)."""
        return bool(self.fixed) or self.path is not None

    def _reload(self, *, initial: bool = False) -> None:
        assert self.path is not None
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp == self._stamp:
                return
            keys = _read_key_file(self.path)
        except (OSError, errors.InvalidArgument) as exc:
            if initial:
                raise errors.InvalidArgument(
                    f"cannot read the API key file {self.path}: {exc}"
                ) from None
            # A file being replaced or briefly unreadable keeps the last good keys.
            log.warning("API key file %s unreadable, keeping its last keys: %s", self.path, exc)
            return
        self._stamp = stamp
        self._from_file = [k.encode() for k in keys]
        if not initial:
            log.info("API key file %s re-read: %d keys", self.path, len(keys))

    def accepts(self, key: bytes) -> bool:
        """Whether ``key`` is one of the accepted keys (constant time per key)."""
        if self.path is not None:
            now = time.monotonic()
            if now - self._checked >= _RECHECK_SECONDS:
                self._checked = now
                self._reload()
        found = False
        for candidate in (*self.fixed, *self._from_file):
            found |= hmac.compare_digest(candidate, key)
        return found


def request_api_key(scope: Scope) -> bytes:
    """The key a request presents: ``Authorization: Bearer KEY``, else ``x-api-key: KEY``
    (Anthropic's header); empty when neither."""
    value = header(scope, b"authorization")
    if value is not None:
        scheme, _, key = value.partition(b" ")
        return key.strip() if scheme.lower() == b"bearer" else b""
    return (header(scope, b"x-api-key") or b"").strip()


def _unauthorized(message: str) -> HttpError:
    return HttpError(401, "invalid_request_error", message, code="invalid_api_key")


class ApiKeyGuard:
    """ASGI middleware: 401 for HTTP requests without an accepted ``Bearer`` key."""

    def __init__(self, app: Any, keys: ApiKeys, exempt: frozenset[str],
                 on_reject: Any = None) -> None:
        self.app = app
        self.keys = keys
        self.exempt = exempt
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt:
            await self.app(scope, receive, send)
            return
        problem = self._problem(scope)
        if problem is None:
            await self.app(scope, receive, send)
            return
        if self.on_reject is not None:
            self.on_reject()
        if scope["path"] in MESSAGES_ROUTES:  # Anthropic's clients read Anthropic's shape
            send = anthropic_send(send)
        await error(send, _unauthorized(problem))

    def _problem(self, scope: Scope) -> str | None:
        """Why the request is refused (None: its key is accepted)."""
        value = header(scope, b"authorization")
        if value is None and header(scope, b"x-api-key") is None:
            return ("You didn't provide an API key. Send it in the Authorization header as "
                    "'Authorization: Bearer YOUR_KEY' (or as 'x-api-key: YOUR_KEY').")
        key = request_api_key(scope)
        if not key:
            return ("The Authorization header must be 'Bearer YOUR_KEY'." if value is not None
                    else "The x-api-key header must not be empty.")
        if not self.keys.accepts(key):
            return "Incorrect API key provided."
        return None


@dataclass(frozen=True)
class TlsFiles:
    """The certificate and key the frontend serves HTTPS with."""

    cert: str
    key: str


def _tls(args: argparse.Namespace) -> TlsFiles | None:
    cert, key = args.tls_cert_file, args.tls_key_file
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise errors.InvalidArgument("--tls-cert-file and --tls-key-file go together")
    try:  # what uvicorn will do, now: a bad file is one line at start, not a traceback
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise errors.InvalidArgument(
            f"cannot load the TLS certificate {cert} with key {key}: {exc}"
        ) from None
    return TlsFiles(cert, key)


#: What ``http_security`` gives: the keys, the exempt routes and the TLS files (None: HTTP).
HttpSecurity = tuple[ApiKeys, frozenset[str], TlsFiles | None]


def http_security(args: argparse.Namespace) -> HttpSecurity:
    """The API keys, exempt routes and TLS files the flags ask for.

    Raises:
        InvalidArgument: an unreadable key file, an empty key, or unusable TLS files.
    """
    fixed = list(args.api_key)
    fixed += [k.strip() for k in os.environ.get("DYN_API_KEYS", "").split(",") if k.strip()]
    if any(not k.strip() or any(c.isspace() for c in k) for k in fixed):
        raise errors.InvalidArgument("an API key must be non-empty and without spaces")
    keys = ApiKeys([k.encode() for k in fixed],
                   Path(args.api_key_file) if args.api_key_file else None)
    exempt = frozenset(p.strip() for p in args.api_key_exempt.split(",") if p.strip())
    bad = [p for p in exempt if not p.startswith("/")]
    if bad:
        raise errors.InvalidArgument(f"--api-key-exempt routes must start with '/': {bad}")
    return keys, exempt, _tls(args)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) reaches this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
