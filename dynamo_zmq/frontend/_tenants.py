"""Per-tenant limits on the frontend (``--tenant-limits FILE``): who a request's tenant is,
its buckets, admission, settlement and metrics.

A request's tenant is its API key (Bearer or ``x-api-key``, the same tenant) when keys are
configured (named by the limits file, else ``key_label``: never the key itself), otherwise its
``x-dynamo-tenant`` header (``anonymous`` without one). Each tenant has a request bucket
(``requests_per_second``, ``burst``) and a token bucket (``tokens_per_minute``), built from
its limits on first sight (``_token_bucket.py``). A request is admitted in two steps:

1. ``Tenants.admit``, as soon as its body is read: one request from the request bucket (429,
   type ``requests``, when empty). Every request that arrives counts, also one refused later.
2. ``Ticket.reserve``, once it is preprocessed: its prompt tokens plus the most it may
   generate (each sequence's ``max_tokens``, which preprocessing sets to the context left
   when the client gave none) from the token bucket (429, type ``tokens``; one that is over
   the whole per-minute budget can never fit: 429 without ``Retry-After``).

``Ticket.settle``, when the request ends however it ends, charges its prompt and the tokens it
generated and returns the rest of the reservation. With ``--http-workers N`` each process
refills the buckets at 1/N of the file's rates (their sizes are the file's).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram

from ._asgi import Scope, header
from ._http_security import request_api_key
from ._tenant_limits import ANONYMOUS, NAME, LimitsFile, LimitTable, TenantLimit
from ._token_bucket import TokenBucket
from .errors import HttpError, bad_request, rate_limited

__all__ = ["TENANT_HEADER", "Tenants", "Ticket"]

log = logging.getLogger("dynamo_zmq.frontend.tenants")

#: The request header that names the tenant when no API keys are configured.
TENANT_HEADER = b"x-dynamo-tenant"
#: Most distinct metric labels for tenants the file does not list (then ``_other``).
MAX_LABELS = 1000
#: Tenants held before idle ones (full buckets, nothing reserved) are forgotten.
MAX_TENANTS = 10_000
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class TenantMetrics:
    """The per-tenant series of ``/metrics`` (label ``tenant``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "dynamo_frontend_tenant_requests",
            "Requests by tenant and outcome (success, error, disconnected, rate_limited)",
            ["tenant", "outcome"], registry=registry,
        )
        self.tokens = Counter(
            "dynamo_frontend_tenant_tokens", "Tokens settled by tenant and kind "
            "(prompt, completion)", ["tenant", "kind"], registry=registry,
        )
        self.rejections = Counter(
            "dynamo_frontend_tenant_rejections",
            "Requests refused with 429 by tenant and limit (requests, tokens)",
            ["tenant", "limit"], registry=registry,
        )
        self.ttft = Histogram(
            "dynamo_frontend_tenant_time_to_first_token_seconds", "Time to first token by "
            "tenant", ["tenant"], buckets=_LATENCY, registry=registry,
        )


class _Tenant:
    """One tenant's buckets (None: no limit of that kind) and outstanding reservations."""

    __slots__ = ("label", "limit", "name", "requests", "reserved", "tokens")

    def __init__(self, name: str, label: str) -> None:
        self.name, self.label = name, label
        self.limit: TenantLimit | None = None
        self.requests: TokenBucket | None = None
        self.tokens: TokenBucket | None = None
        self.reserved = 0

    def configure(self, limit: TenantLimit, share: int, now: float) -> None:
        """Apply ``limit`` (a bucket's level so far is kept, up to its new size)."""
        if limit == self.limit:
            return
        self.limit = limit
        self.requests = _bucket(self.requests, limit.requests_per_second, limit.burst, share,
                                now)
        tpm = limit.tokens_per_minute
        self.tokens = _bucket(self.tokens, None if tpm is None else tpm / 60.0, tpm, share, now)

    def idle(self, now: float) -> bool:
        return self.reserved == 0 and all(
            b is None or b.full(now) for b in (self.requests, self.tokens)
        )


def _bucket(bucket: TokenBucket | None, rate: float | None, size: float | None, share: int,
            now: float) -> TokenBucket | None:
    if rate is None or size is None:
        return None
    if bucket is None:
        return TokenBucket(rate / share, size, now)
    bucket.reconfigure(rate / share, size, now)
    return bucket


class Tenants:
    """The frontend's tenants under the limits of ``limits``.

    Args:
        limits: the limits file.
        keys_enabled: API keys are configured (a request's tenant is then its key).
        registry: where the per-tenant metrics go.
        share: the processes serving the port (``--http-workers``): each refills at 1/share.
        clock: seconds, monotonic.
    """

    def __init__(self, limits: LimitsFile, keys_enabled: bool, registry: CollectorRegistry,
                 share: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.keys_enabled = keys_enabled
        self.metrics = TenantMetrics(registry)
        self.share = max(1, share)
        self.clock = clock
        self._tenants: dict[str, _Tenant] = {}
        self._labels: set[str] = set()
        self._version = limits.version
        self._pruned = 0.0

    def identify(self, scope: Scope, table: LimitTable) -> str:
        """The tenant of a request.

        Raises:
            HttpError: 400 for an ``x-dynamo-tenant`` that is not a tenant name.
        """
        batch_tenant = scope.get("dynamo.batch_tenant")  # a batch line (_batch_call.py)
        if isinstance(batch_tenant, str):
            return batch_tenant
        if self.keys_enabled:
            key = request_api_key(scope)  # Bearer or x-api-key: the same tenant
            return table.key_name(key) if key else ANONYMOUS
        value = header(scope, TENANT_HEADER)
        if value is None:
            return ANONYMOUS
        name = value.decode("latin-1").strip()
        if not NAME.fullmatch(name):
            raise bad_request(
                f"{TENANT_HEADER.decode()}: a tenant name is 1-64 letters, digits or ._:@- "
                "(first a letter or digit)", param=TENANT_HEADER.decode(),
            )
        return name

    def _tenant(self, name: str, table: LimitTable, now: float) -> _Tenant:
        if self.limits.version != self._version:  # the file changed: new limits for all
            self._version = self.limits.version
            for known in self._tenants.values():
                known.configure(table.limit(known.name), self.share, now)
        tenant = self._tenants.get(name)
        if tenant is None:
            if len(self._tenants) >= MAX_TENANTS and now - self._pruned >= 1.0:
                self._pruned = now
                self._tenants = {k: t for k, t in self._tenants.items() if not t.idle(now)}
            # API keys are as many as configured; header names are whatever clients send
            listed = self.keys_enabled or name in table.tenants or name == ANONYMOUS
            label = name
            if not listed and name not in self._labels:
                if len(self._labels) >= MAX_LABELS:
                    label = "_other"
                else:
                    self._labels.add(name)
            tenant = self._tenants[name] = _Tenant(name, label)
            tenant.configure(table.limit(name), self.share, now)
        return tenant

    def admit(self, scope: Scope) -> Ticket:
        """Step 1 of admission: the request's tenant and one request from its bucket.

        Raises:
            HttpError: 429 (type ``requests``) when its request bucket is empty; 400 for a
                bad ``x-dynamo-tenant``.
        """
        table = self.limits.current()
        now = self.clock()
        tenant = self._tenant(self.identify(scope, table), table, now)
        bucket = tenant.requests
        if bucket is not None:
            wait = bucket.take(1, now)
            if wait:
                self._reject(tenant, "requests")
                limit = tenant.limit
                assert limit is not None
                raise rate_limited(
                    f"Rate limit reached for tenant '{tenant.label}' on requests per second "
                    f"(RPS): Limit {limit.requests_per_second:g}, burst {limit.burst}"
                    f"{self._per_process()}. Please try again in {wait:.2f}s.",
                    "requests", wait,
                )
        return Ticket(self, tenant)

    def _per_process(self) -> str:
        return "" if self.share == 1 else f", refilled at 1/{self.share} per HTTP process"

    def _reject(self, tenant: _Tenant, limit: str) -> None:
        m = self.metrics
        m.rejections.labels(tenant.label, limit).inc()
        m.requests.labels(tenant.label, "rate_limited").inc()


class Ticket:
    """One admitted request of a tenant: its reservation, settled once at its end."""

    __slots__ = ("_holding", "_settled", "owner", "reserved", "tenant")

    def __init__(self, owner: Tenants, tenant: _Tenant) -> None:
        self.owner, self.tenant = owner, tenant
        self.reserved = 0
        self._holding = self._settled = False

    @property
    def label(self) -> str:
        """The tenant's metric label."""
        return self.tenant.label

    def reserve(self, prompt: int, completion: int) -> None:
        """Step 2 of admission: reserve ``prompt`` tokens and ``completion`` more (the most the
        request may generate).

        Raises:
            HttpError: 429 (type ``tokens``): with ``Retry-After`` when the budget lacks them
                now; without, when they are more than the whole per-minute budget.
        """
        tenant, owner = self.tenant, self.owner
        amount = prompt + completion
        bucket = tenant.tokens
        if bucket is None:
            self._hold(amount)
            return
        now = owner.clock()
        wait = bucket.take(amount, now)
        if not wait:
            self._hold(amount)
            return
        owner._reject(tenant, "tokens")
        self._settled = True
        tpm = int(bucket.capacity)
        asked = f"Requested {amount} ({prompt} in the prompt, up to {completion} in the completion)"
        if wait == float("inf"):
            raise rate_limited(
                f"Request too large for tenant '{tenant.label}' on tokens per min (TPM): Limit "
                f"{tpm}, {asked}. It can never fit: reduce the prompt or max_tokens.",
                "tokens", None,
            )
        raise rate_limited(
            f"Rate limit reached for tenant '{tenant.label}' on tokens per min (TPM): Limit "
            f"{tpm}{owner._per_process()}, Available {max(0, int(bucket.level))}, {asked}. "
            f"Please try again in {wait:.2f}s.", "tokens", wait,
        )

    def _hold(self, amount: int) -> None:
        self.reserved, self._holding = amount, True
        self.tenant.reserved += 1

    def refused(self, exc: HttpError) -> None:
        """The request was refused before it ran (a bad request, no worker): count it."""
        if not self._settled:
            self.settle("rate_limited" if exc.status == 429 else "error", 0, 0, None)

    def settle(self, outcome: str, prompt: int, completion: int, ttft: float | None) -> None:
        """The request ended (``outcome``: its status): charge what it used, return the rest of
        its reservation, count it (once; later calls do nothing)."""
        if self._settled:
            return
        self._settled = True
        tenant, m, label = self.tenant, self.owner.metrics, self.tenant.label
        used = prompt + completion
        if self._holding:
            tenant.reserved -= 1
        bucket = tenant.tokens
        if bucket is not None and self._holding:
            now = self.owner.clock()
            if used <= self.reserved:
                bucket.give(self.reserved - used, now)
            else:  # a model without a known context length: what it generated beyond
                bucket.charge(used - self.reserved, now)
        m.requests.labels(label, outcome).inc()
        if prompt:
            m.tokens.labels(label, "prompt").inc(prompt)
        if completion:
            m.tokens.labels(label, "completion").inc(completion)
        if ttft is not None:
            m.ttft.labels(label).observe(ttft)
