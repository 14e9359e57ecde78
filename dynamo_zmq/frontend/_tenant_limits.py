"""The tenant limits file (``--tenant-limits FILE``): TOML, read with the standard library.

    # Every tenant not listed below gets these limits, each its own budget (no [default]:
    # unlisted tenants are not limited).
    [default]
    requests_per_second = 5     # the refill rate of the request bucket
    burst = 10                  # its size: requests admitted at once (default: the rate, >= 1)
    tokens_per_minute = 60000   # the token budget (a bucket of this size refilled per minute)

    [tenants.team-a]
    requests_per_second = 20
    tokens_per_minute = 500000
    keys = ["sk-team-a-1"]      # API keys that are this tenant (optional)

    [tenants.key-3f9a0c1b2d4e]  # an API key by its label, without writing the key here
    tokens_per_minute = 10000

A limit left out is no limit of that kind. Tenant names are 1-64 characters of letters,
digits and ``._:@-`` (first a letter or digit). ``LimitsFile`` re-reads the file when it
changes (checked at most once a second): a file that no longer parses keeps the last good
limits and is logged once.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from .. import errors

__all__ = [
    "ANONYMOUS",
    "NAME",
    "LimitTable",
    "LimitsFile",
    "TenantLimit",
    "add_tenant_args",
    "key_label",
    "limits_file",
    "parse_limits",
]

log = logging.getLogger("dynamo_zmq.frontend.tenants")

#: A tenant's name: in the file, in ``x-dynamo-tenant``, in metric labels.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,63}")
#: The tenant of a request without ``x-dynamo-tenant`` (when no API keys are configured).
ANONYMOUS = "anonymous"
#: How often, at most, the file's modification stamp is checked.
_RECHECK_SECONDS = 1.0
_FIELDS = {"requests_per_second", "burst", "tokens_per_minute"}


def key_label(key: bytes) -> str:
    """The name of an API key not listed in the file: ``key-`` and 12 hex digits of its SHA-256
    (stable, and never the key itself)."""
    return "key-" + hashlib.sha256(key).hexdigest()[:12]


@dataclass(frozen=True)
class TenantLimit:
    """One tenant's limits (None: no limit of that kind).

    Attributes:
        requests_per_second: the request bucket's refill rate.
        burst: the request bucket's size.
        tokens_per_minute: the token bucket's size, refilled over a minute.
    """

    requests_per_second: float | None = None
    burst: int | None = None
    tokens_per_minute: int | None = None


NO_LIMIT = TenantLimit()


@dataclass(frozen=True)
class LimitTable:
    """What the file says: the default, each named tenant's limits, and API keys' names."""

    default: TenantLimit = NO_LIMIT
    tenants: dict[str, TenantLimit] = field(default_factory=dict)
    #: SHA-256 digest of an API key -> its tenant's name (keys are not kept).
    key_names: dict[bytes, str] = field(default_factory=dict)

    def limit(self, name: str) -> TenantLimit:
        """The limits of tenant ``name`` (the default when it is not listed)."""
        return self.tenants.get(name, self.default)

    def key_name(self, key: bytes) -> str:
        """The tenant an API key is: its name from the file, else ``key_label``."""
        return self.key_names.get(hashlib.sha256(key).digest()) or key_label(key)


def _number(where: str, name: str, value: Any, *, whole: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or (
        whole and not isinstance(value, int)
    ):
        kind = "a whole number" if whole else "a number"
        raise errors.InvalidArgument(f"{where}: {name} must be {kind}, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise errors.InvalidArgument(f"{where}: {name} must be > 0, got {value!r}")
    return value


def _limit(where: str, table: Any, *, allow_keys: bool) -> TenantLimit:
    if not isinstance(table, dict):
        raise errors.InvalidArgument(f"{where} must be a table, got {table!r}")
    allowed = _FIELDS | ({"keys"} if allow_keys else set())
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise errors.InvalidArgument(
            f"{where}: unknown field(s) {unknown} (known: {sorted(allowed)})"
        )
    rps = table.get("requests_per_second")
    burst = table.get("burst")
    tpm = table.get("tokens_per_minute")
    if rps is not None:
        rps = float(_number(where, "requests_per_second", rps))
    if burst is not None:
        if rps is None:
            raise errors.InvalidArgument(f"{where}: burst needs requests_per_second")
        burst = int(_number(where, "burst", burst, whole=True))
    elif rps is not None:
        burst = max(1, math.ceil(rps))
    if tpm is not None:
        tpm = int(_number(where, "tokens_per_minute", tpm, whole=True))
    return TenantLimit(rps, burst, tpm)


def parse_limits(text: str, source: str = "the tenant limits file") -> LimitTable:
    """The limits of a TOML text.

    Raises:
        InvalidArgument: not TOML, an unknown table or field, a bad value or name, a key
            given to two tenants.
    """
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise errors.InvalidArgument(f"{source} is not valid TOML: {exc}") from None
    unknown = sorted(set(doc) - {"default", "tenants"})
    if unknown:
        raise errors.InvalidArgument(
            f"{source}: unknown top-level entr(ies) {unknown} (known: [default], [tenants.NAME])"
        )
    default = _limit(f"{source}: [default]", doc.get("default", {}), allow_keys=False)
    tenants: dict[str, TenantLimit] = {}
    key_names: dict[bytes, str] = {}
    section = doc.get("tenants", {})
    if not isinstance(section, dict):
        raise errors.InvalidArgument(f"{source}: tenants must be tables [tenants.NAME]")
    for name, table in section.items():
        where = f"{source}: [tenants.{name}]"
        if not NAME.fullmatch(name):
            raise errors.InvalidArgument(
                f"{where}: a tenant name is 1-64 letters, digits or ._:@- (first a letter or "
                "digit)"
            )
        tenants[name] = _limit(where, table, allow_keys=True)
        keys = table.get("keys", [])
        if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
            raise errors.InvalidArgument(f"{where}: keys must be a list of non-empty strings")
        for key in keys:
            digest = hashlib.sha256(key.strip().encode()).digest()
            if digest in key_names:
                raise errors.InvalidArgument(
                    f"{where}: an API key is also a key of [tenants.{key_names[digest]}]"
                )
            key_names[digest] = name
    return LimitTable(default, tenants, key_names)


class LimitsFile:
    """The limits of a file, re-read when its modification stamp changes.

    Raises:
        InvalidArgument: (at construction) the file cannot be read or parsed.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        #: Bumped at every successful re-read (a reader re-applies the limits then).
        self.version = 0
        self._checked = time.monotonic()
        self._stamp, text = self._read()
        self.table = parse_limits(text, str(path))
        self._bad_stamp: tuple[int, int] | None = None

    def _read(self) -> tuple[tuple[int, int], str]:
        try:
            st = self.path.stat()
            return (st.st_mtime_ns, st.st_size), self.path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise errors.InvalidArgument(
                f"cannot read the tenant limits file {self.path}: {exc}"
            ) from None

    def current(self) -> LimitTable:
        """The limits now (the file re-read if it changed since the last look)."""
        now = time.monotonic()
        if now - self._checked >= _RECHECK_SECONDS:
            self._checked = now
            self._reload()
        return self.table

    def _reload(self) -> None:
        try:
            st = self.path.stat()
        except OSError as exc:
            self._bad(None, exc)
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp or stamp == self._bad_stamp:
            return
        try:
            stamp, text = self._read()
            table = parse_limits(text, str(self.path))
        except errors.InvalidArgument as exc:
            self._bad(stamp, exc)
            return
        self._stamp, self._bad_stamp, self.table = stamp, None, table
        self.version += 1
        log.info("tenant limits file %s re-read: %d tenants listed%s", self.path, len(
            table.tenants), ", a default" if table.default != NO_LIMIT else "")

    def _bad(self, stamp: tuple[int, int] | None, exc: Exception) -> None:
        if stamp is not None and stamp == self._bad_stamp:
            return
        if stamp is None and self._bad_stamp == (0, 0):
            return
        self._bad_stamp = stamp if stamp is not None else (0, 0)
        message = exc.message if isinstance(exc, errors.DynamoError) else str(exc)
        log.warning("tenant limits file %s: %s; keeping the last good limits", self.path,
                    message)


def add_tenant_args(parser: argparse.ArgumentParser) -> None:
    """The frontend's ``--tenant-limits`` flag."""
    parser.add_argument(
        "--tenant-limits", metavar="FILE", default=os.environ.get("DYN_TENANT_LIMITS"),
        help="a TOML file of per-tenant limits (requests/s with a burst, tokens/min, a default); "
             "a tenant is the API key, or the x-dynamo-tenant header without keys; re-read "
             "when it changes [DYN_TENANT_LIMITS]",
    )


def limits_file(args: argparse.Namespace) -> LimitsFile | None:
    """The ``--tenant-limits`` file, read (None: not given).

    Raises:
        InvalidArgument: it cannot be read or parsed.
    """
    return LimitsFile(Path(args.tenant_limits)) if args.tenant_limits else None
