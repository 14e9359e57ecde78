"""Roles of authorized keys, and what each role may do on the cluster's sockets.

An authorized key (``DIR/authorized/NAME.key``, ``python -m dynamo_zmq.keys authorize
--role``) carries one or more roles. A key authorized without a role (every key authorized
before roles existed) holds every role: the flat trust it was given then.

Where a role is checked (docs/security.md has the table):

* connecting at all: by the ZAP handler, per kind of socket (its ZAP *domain*, ``Domain``):
  ``ADMITTED`` says which roles each kind admits;
* sending a request: by the server, per endpoint (``Server``'s ``callers``): a worker's
  endpoints admit ``WORKER_CALLERS``, any other ``DEFAULT_CALLERS``;
* being dialled as a server: by callers. A key without a ``SERVING`` role is never dialled;
  a model is routed to only when its instance's key holds ``WORKER`` (``dynamo_zmq.llm``).
"""

from __future__ import annotations

from collections.abc import Iterable

from .. import errors

__all__ = [
    "ADMITTED",
    "DEFAULT_CALLERS",
    "EVERY_ROLE",
    "FRONTEND",
    "KEY_ROLES",
    "ROUTER",
    "SERVING",
    "TOOL",
    "WORKER",
    "WORKER_CALLERS",
    "Domain",
    "format_roles",
    "parse_roles",
]

WORKER, FRONTEND, ROUTER, TOOL = "worker", "frontend", "router", "tool"
#: Every role, in the order they are listed.
KEY_ROLES = (WORKER, FRONTEND, ROUTER, TOOL)
EVERY_ROLE = frozenset(KEY_ROLES)

#: Roles whose holders serve endpoints (a tool only calls): callers dial no other key.
SERVING = frozenset({WORKER, FRONTEND, ROUTER})
#: Roles that may send requests to an endpoint served without its own ``callers``.
DEFAULT_CALLERS = frozenset({WORKER, FRONTEND, ROUTER})
#: Roles that may send requests to a worker's endpoints (generate, model files, clear KV).
WORKER_CALLERS = frozenset({WORKER, FRONTEND})


class Domain:
    """ZAP domains: the kind of socket a connection is made to (``make_socket``'s
    ``zap_domain``). A bound socket given none admits every role."""

    REQUEST = "request"  # the request plane's ROUTER: describe, ping, requests
    KV_EVENTS = "kv-events"  # KV events (PUB) and their replay (ROUTER)
    LOAD = "load"  # load reports (PUB)
    REPLICA = "replica"  # router replica sync (PUB)
    KV_TRANSFER = "kv-transfer"  # a prefill worker's KV blocks (disaggregation)


#: Which roles each kind of socket admits.
ADMITTED: dict[str, frozenset[str]] = {
    Domain.REQUEST: EVERY_ROLE,  # a tool reads status; requests are checked per endpoint
    Domain.KV_EVENTS: frozenset({WORKER, FRONTEND, ROUTER}),
    Domain.LOAD: EVERY_ROLE,  # status --watch follows load reports
    Domain.REPLICA: frozenset({WORKER, FRONTEND, ROUTER}),
    Domain.KV_TRANSFER: frozenset({WORKER}),
}


def parse_roles(text: str | Iterable[str]) -> frozenset[str]:
    """Roles from ``"worker,frontend"`` (or several such words); ``all`` is every role.

    Raises:
        InvalidArgument: an unknown role, or none at all.
    """
    words = [text] if isinstance(text, str) else list(text)
    roles: set[str] = set()
    for word in words:
        for part in word.split(","):
            role = part.strip().lower()
            if role == "all":
                roles |= EVERY_ROLE
            elif role in EVERY_ROLE:
                roles.add(role)
            elif role:
                raise errors.InvalidArgument(
                    f"unknown key role {part.strip()!r}: use {', '.join(KEY_ROLES)} or all"
                )
    if not roles:
        raise errors.InvalidArgument(f"no key role given: use {', '.join(KEY_ROLES)} or all")
    return frozenset(roles)


def format_roles(roles: Iterable[str]) -> str:
    """``"worker,frontend"``, in ``KEY_ROLES`` order (``"-"`` for none)."""
    given = set(roles)
    return ",".join(r for r in KEY_ROLES if r in given) or "-"
