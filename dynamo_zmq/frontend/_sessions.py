"""Session affinity at the frontend: the session a request names (``X-Dynamo-Session-ID``, or
an agent's own session header as Dynamo recognises them) and the ``--session-ttl`` and
``--max-sessions`` flags. The router pins (``llm/_sessions.py``) do the rest."""

from __future__ import annotations

import argparse
import math
import os

from ..errors import InvalidArgument
from ..llm import DEFAULT_MAX_SESSIONS, DEFAULT_SESSION_TTL, SessionConfig
from ._asgi import Scope
from .errors import bad_request

__all__ = ["MAX_SESSION_ID", "SESSION_HEADERS", "add_session_args", "session_config",
           "session_id"]

#: Longest session id accepted (bytes of printable ASCII).
MAX_SESSION_ID = 256
#: Request headers naming the session, the first present wins: Dynamo's own, then the coding
#: agents' that Dynamo recognises (Claude Code's child agent, then its session; Codex; OpenCode).
SESSION_HEADERS = (
    b"x-dynamo-session-id", b"x-claude-code-agent-id", b"x-claude-code-session-id",
    b"session-id", b"x-session-id",
)


def session_id(scope: Scope) -> str | None:
    """The session the request in ``scope`` names (None: none).

    Raises:
        HttpError: 400 when the header's value is empty, longer than ``MAX_SESSION_ID`` or not
            printable ASCII.
    """
    found: dict[bytes, bytes] = {}
    for key, value in scope.get("headers", ()):
        name = bytes(key).lower()
        if name in SESSION_HEADERS and name not in found:
            found[name] = bytes(value)
    for name in SESSION_HEADERS:
        raw = found.get(name)
        if raw is None:
            continue
        if not raw or len(raw) > MAX_SESSION_ID or not all(0x20 <= b <= 0x7E for b in raw):
            raise bad_request(
                f"{name.decode()}: a session id is 1-{MAX_SESSION_ID} printable ASCII "
                f"characters, got {raw[:40]!r}{'...' if len(raw) > 40 else ''}",
                param=name.decode(), code="invalid_value",
            )
        return raw.decode("ascii")
    return None


def add_session_args(parser: argparse.ArgumentParser) -> None:
    """``--session-ttl`` and ``--max-sessions`` (with their DYN_* variables)."""
    env = os.environ.get
    parser.add_argument(
        "--session-ttl", type=float, default=env("DYN_SESSION_TTL", str(DEFAULT_SESSION_TTL)),
        metavar="SECONDS",
        help="session affinity: a request naming a session (x-dynamo-session-id) goes to the "
             "worker that served the session last, for this long after its last request; "
             "0 = off [DYN_SESSION_TTL]",
    )
    parser.add_argument(
        "--max-sessions", type=int, default=env("DYN_MAX_SESSIONS", str(DEFAULT_MAX_SESSIONS)),
        metavar="N",
        help="session affinity: most sessions pinned per model; the least recently used are "
             "unpinned beyond [DYN_MAX_SESSIONS]",
    )


def session_config(args: argparse.Namespace) -> SessionConfig:
    """The pins' configuration from the flags.

    Raises:
        InvalidArgument: a negative or not finite TTL, or a cap below 1.
    """
    ttl = float(args.session_ttl)
    if not (math.isfinite(ttl) and ttl >= 0):
        raise InvalidArgument(f"--session-ttl must be a finite number >= 0, got {ttl}")
    if args.max_sessions < 1:
        raise InvalidArgument(f"--max-sessions must be >= 1, got {args.max_sessions}")
    return SessionConfig(ttl=ttl, max_sessions=args.max_sessions)
