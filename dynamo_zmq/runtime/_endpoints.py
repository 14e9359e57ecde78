"""``ServedEndpoints``: the endpoints one runtime serves, with their handlers, callers, health
verdicts and metadata.

It answers what the server dispatches to (``handlers``), which key roles may call each endpoint
(``callers``), what DESCRIBE lists (the healthy endpoints, ``listed``) and which components a
namespace's advert names (``components``). ``DistributedRuntime`` owns one; it bumps the
server's rev and re-advertises when the table changes.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..transport import DEFAULT_CALLERS
from ..transport import Handler as TransportHandler
from ..wire import EndpointInfo

__all__ = ["ServedEndpoints"]


class ServedEndpoints:
    """The endpoints served by one process, healthy (listed) or not."""

    def __init__(self) -> None:
        #: The handler of each served path (the server dispatches with ``handlers.get``).
        self.handlers: dict[str, TransportHandler] = {}
        #: The key roles that may call each endpoint (auth on; default DEFAULT_CALLERS).
        self._callers: dict[str, frozenset[str]] = {}
        self._listed: dict[str, EndpointInfo] = {}
        #: Endpoints whose health check failed: still served, but not listed in the description
        #: (so no caller routes new work to them) until the check passes again.
        self._unhealthy: dict[str, EndpointInfo] = {}

    def add(
        self, info: EndpointInfo, handler: TransportHandler, callers: frozenset[str]
    ) -> None:
        """Serve ``handler`` as ``info.path``, listed (healthy) until told otherwise."""
        self.handlers[info.path] = handler
        self._callers[info.path] = callers
        self._unhealthy.pop(info.path, None)
        self._listed[info.path] = info

    def remove(self, path: str) -> EndpointInfo | None:
        """Stop serving ``path``; returns its info (None: it was not served)."""
        info = self._listed.pop(path, None) or self._unhealthy.pop(path, None)
        self.handlers.pop(path, None)
        return info

    def callers(self, path: str) -> frozenset[str]:
        return self._callers.get(path, DEFAULT_CALLERS)

    def listed(self) -> list[EndpointInfo]:
        """The healthy endpoints: what the description lists."""
        return list(self._listed.values())

    def served(self) -> list[EndpointInfo]:
        """Every served endpoint, healthy or not."""
        return [*self._listed.values(), *self._unhealthy.values()]

    def serves_namespace(self, namespace: str) -> bool:
        return any(e.namespace == namespace for e in self.served())

    def components(self, namespace: str) -> tuple[str, ...]:
        """The components served in ``namespace``, sorted (what its advert names)."""
        return tuple(sorted({e.component for e in self.served() if e.namespace == namespace}))

    def set_health(self, path: str, healthy: bool) -> bool:
        """List (``healthy``) or unlist endpoint ``path``; returns whether that changed
        anything (False for a path not served, or already so)."""
        if healthy and path in self._unhealthy:
            self._listed[path] = self._unhealthy.pop(path)
        elif not healthy and path in self._listed:
            self._unhealthy[path] = self._listed.pop(path)
        else:
            return False
        return True

    def set_metadata(self, path: str, metadata: dict[str, Any]) -> bool:
        """Replace endpoint ``path``'s metadata; returns False for a path not served."""
        for table in (self._listed, self._unhealthy):
            if path in table:
                table[path] = msgspec.structs.replace(table[path], metadata=metadata)
                return True
        return False
