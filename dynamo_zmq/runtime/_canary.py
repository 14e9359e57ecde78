"""Health canaries for endpoints served with the runtime API alone (Dynamo's
``serve_endpoint(handler, health_check_payload=...)``).

An endpoint given a payload has its own handler called with that payload after it has had no
request for ``DYN_CANARY_WAIT_TIME`` seconds (default 10), and as often while requests keep
coming: a handler that is stuck still has requests started on it, so traffic proves nothing.
The check passes when the handler
yields its first response (or ends cleanly) within ``DYN_HEALTH_CHECK_REQUEST_TIMEOUT`` seconds
(default 3); anything else (an exception, a timeout) fails it. The verdict goes to
``DistributedRuntime.set_endpoint_health``: a failing endpoint leaves routing, a passing one
comes back. ``DYN_HEALTH_CHECK_ENABLED=false`` turns the canaries off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from ..context import Context
from ..errors import InvalidArgument
from ..transport import Handler
from ..wire import encode_item

__all__ = ["CanaryConfig", "CanaryHost", "EndpointCanary"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CanaryConfig:
    """When canaries run and how long one may take (Dynamo's variables in brackets)."""

    #: Run canaries at all [DYN_HEALTH_CHECK_ENABLED].
    enabled: bool = True
    #: Idle seconds before a canary is sent [DYN_CANARY_WAIT_TIME].
    wait_time: float = 10.0
    #: Seconds the first response may take [DYN_HEALTH_CHECK_REQUEST_TIMEOUT].
    request_timeout: float = 3.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> CanaryConfig:
        enabled = environ.get("DYN_HEALTH_CHECK_ENABLED", "true").strip().lower()
        return cls(
            enabled=enabled not in ("0", "false", "no", "off"),
            wait_time=_positive(environ, "DYN_CANARY_WAIT_TIME", cls.wait_time),
            request_timeout=_positive(
                environ, "DYN_HEALTH_CHECK_REQUEST_TIMEOUT", cls.request_timeout
            ),
        )


def _positive(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise InvalidArgument(f"{name} must be a positive number of seconds, got {raw!r}")
    return value


class CanaryHost(Protocol):
    """Where a canary's verdict goes (``DistributedRuntime``)."""

    def set_endpoint_health(self, path: str, healthy: bool) -> None: ...


class EndpointCanary:
    """Sends ``payload`` to one endpoint's own handler when the endpoint is idle.

    Args:
        host: receives the verdicts.
        path: the endpoint.
        handler: the endpoint's handler as the transport runs it.
        payload: the request the canary sends (any MessagePack-able value).
        config: the timings.
    """

    def __init__(
        self, host: CanaryHost, path: str, handler: Handler, payload: Any, config: CanaryConfig
    ) -> None:
        self.host = host
        self.path = path
        self._handler = handler
        self._payload = encode_item(payload)
        self.config = config
        self.last_request = self.last_probe = time.monotonic()
        self.healthy = True

    def watch(self) -> Handler:
        """The handler to serve: ``handler`` noting when each request starts (one call per
        request; the items flow from the handler's own iterator, untouched)."""
        handler = self._handler

        def run(payload: msgspec.Raw, ctx: Context) -> AsyncIterator[Any]:
            self.last_request = time.monotonic()
            return handler(payload, ctx)

        return run

    async def probe(self) -> bool:
        """Send the payload once; True if the first response (or a clean end) comes in time."""
        ctx = Context(f"health-{time.monotonic_ns()}")
        stream: AsyncIterator[Any] | None = None
        try:
            stream = self._handler(self._payload, ctx)
            async with asyncio.timeout(self.config.request_timeout):
                await anext(stream, None)
            return True
        except Exception as exc:
            log.warning("health check of %s failed: %s: %s", self.path, type(exc).__name__, exc)
            return False
        finally:
            ctx.kill()
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    async def run(self) -> None:
        """Forever: once idle for ``wait_time``, or ``wait_time`` after the last probe while
        busy, probe and report the verdict."""
        wait = self.config.wait_time
        while True:
            now = time.monotonic()
            idle, since = now - self.last_request, now - self.last_probe
            if idle < wait and since < wait:
                await asyncio.sleep(wait - max(idle, since))
                continue
            ok = await self.probe()
            if ok != self.healthy:
                self.healthy = ok
                self.host.set_endpoint_health(self.path, ok)
            self.last_request = self.last_probe = time.monotonic()
