"""Per-tenant limits, in process: the token bucket's arithmetic, reservation and settlement
accounting (hypothesis), and the limits file's format. The frontend end to end is
tests/test_tenants.py."""

from __future__ import annotations

import hashlib
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from dynamo_zmq import errors
from dynamo_zmq.frontend._tenant_limits import (
    ANONYMOUS,
    LimitTable,
    TenantLimit,
    key_label,
    parse_limits,
)
from dynamo_zmq.frontend._tenants import Tenants
from dynamo_zmq.frontend._token_bucket import TokenBucket
from dynamo_zmq.frontend.errors import HttpError

# -- the token bucket ---------------------------------------------------------------------

#: (seconds to advance, amount to take, fraction of an earlier take to give back)
STEPS = st.lists(
    st.tuples(st.floats(0, 5), st.floats(0, 120), st.floats(0, 1)), min_size=1, max_size=60
)


@settings(max_examples=300, deadline=None)
@given(rate=st.floats(0.1, 50), capacity=st.floats(1, 100), steps=STEPS)
def test_bucket_never_admits_more_than_its_size_plus_its_refill(rate, capacity, steps):
    """Whatever the order of takes and returns, what is held (taken and not given back) up to
    any moment is at most the capacity plus what the time since the start refilled; a take
    succeeds exactly when the refilled level holds it, and the wait it names is exact."""
    bucket = TokenBucket(rate, capacity, 0.0)
    now, held = 0.0, 0.0
    for advance, amount, back in steps:
        now += advance
        expected = min(capacity, bucket.level + (now - bucket.stamp) * rate)
        wait = bucket.take(amount, now)
        assert bucket.level <= capacity + 1e-9
        if amount > capacity:
            assert wait == math.inf
            continue
        assert (wait == 0.0) == (amount <= expected)
        if wait:
            assert wait == pytest.approx((amount - expected) / rate, rel=1e-6, abs=1e-9)
            # after exactly that wait, it fits
            probe = TokenBucket(rate, capacity, 0.0)
            probe.level, probe.stamp = bucket.level, bucket.stamp
            assert probe.take(amount, now + wait + 1e-9) == 0.0
            continue
        returned = amount * back
        bucket.give(returned, now)
        held += amount - returned
        assert bucket.level <= capacity + 1e-9
        assert held <= capacity + rate * now + 1e-6


def test_bucket_debt_is_paid_by_the_refill():
    bucket = TokenBucket(10.0, 100.0, 0.0)
    assert bucket.take(100, 0.0) == 0.0
    bucket.charge(50, 0.0)  # used more than it reserved: 50 in debt
    assert bucket.wait(10, 0.0) == pytest.approx(6.0)  # 50 of debt and 10 more at 10/s
    assert bucket.take(10, 6.0) == 0.0


def test_bucket_reconfigured_keeps_its_level_within_the_new_size():
    bucket = TokenBucket(1.0, 100.0, 0.0)
    bucket.take(30, 0.0)
    bucket.reconfigure(2.0, 50.0, 0.0)
    assert bucket.level == 50.0
    bucket.reconfigure(2.0, 200.0, 0.0)
    assert bucket.level == 50.0 and bucket.wait(60, 0.0) == pytest.approx(5.0)


# -- reservations and settlements ---------------------------------------------------------


class _Limits:
    """A ``LimitsFile`` that holds a table (no file)."""

    def __init__(self, table: LimitTable) -> None:
        self.table, self.version = table, 0

    def current(self) -> LimitTable:
        return self.table


def _tenants(limit: TenantLimit, clock=lambda: 0.0, keys: bool = False) -> Tenants:
    return Tenants(_Limits(LimitTable(default=limit)), keys, CollectorRegistry(), clock=clock)


def _scope(tenant: str | None = None, key: str | None = None) -> dict:
    headers = []
    if tenant is not None:
        headers.append((b"x-dynamo-tenant", tenant.encode()))
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    return {"headers": headers}


#: (prompt, max completion, fraction of it generated)
REQUESTS = st.lists(
    st.tuples(st.integers(1, 400), st.integers(0, 600), st.floats(0, 1)), max_size=40
)


@settings(max_examples=200, deadline=None)
@given(budget=st.integers(1, 2000), requests=REQUESTS, settle_order=st.randoms())
def test_reservations_settle_back_to_what_was_used(budget, requests, settle_order):
    """Time stands still (no refill): a reservation fits exactly when the budget left holds
    it; one over the whole budget is refused as never fitting; the budget left is always the
    size less what is reserved and what settled requests used."""
    tenants = _tenants(TenantLimit(tokens_per_minute=budget))
    open_tickets, used = [], 0
    for prompt, most, fraction in requests:
        ticket = tenants.admit(_scope("t"))
        bucket = ticket.tenant.tokens
        left = bucket.level
        asked = prompt + most
        try:
            ticket.reserve(prompt, most)
        except HttpError as exc:
            assert exc.status == 429 and exc.type == "tokens"
            assert exc.code == "rate_limit_exceeded"
            if asked > budget:
                assert exc.retry_after is None and (b"x-should-retry", b"false") in exc.headers
                assert "never fit" in exc.message
            else:
                assert asked > left and exc.retry_after >= 1
            continue
        assert asked <= left
        open_tickets.append((ticket, prompt, int(most * fraction)))
        if len(open_tickets) > 3:  # settle one, in a random order
            ticket, p, c = open_tickets.pop(settle_order.randrange(len(open_tickets)))
            ticket.settle("success", p, c, 0.1)
            ticket.settle("success", p, c, 0.1)  # a second settle does nothing
            used += p + c
        reserved = sum(t.reserved for t, _, _ in open_tickets)
        assert bucket.level == pytest.approx(budget - reserved - used)
    for ticket, p, c in open_tickets:
        ticket.settle("disconnected", p, c, None)
        used += p + c
    if requests:
        assert ticket.tenant.tokens.level == pytest.approx(budget - used)
        assert ticket.tenant.reserved == 0


def test_request_rate_burst_then_retry_after():
    now = [0.0]
    tenants = _tenants(TenantLimit(requests_per_second=0.5, burst=2), clock=lambda: now[0])
    tenants.admit(_scope("a"))
    tenants.admit(_scope("a"))
    with pytest.raises(HttpError) as info:
        tenants.admit(_scope("a"))
    assert info.value.status == 429 and info.value.type == "requests"
    assert info.value.retry_after == 2  # one request every 2 s
    tenants.admit(_scope("b"))  # another tenant has its own bucket
    now[0] = 2.0
    tenants.admit(_scope("a"))


def test_tenant_names_never_show_a_key():
    tenants = _tenants(TenantLimit(requests_per_second=0.01, burst=1), keys=True)
    ticket = tenants.admit(_scope(key="sk-secret", tenant="ignored-with-keys"))
    assert ticket.label == key_label(b"sk-secret") and "secret" not in ticket.label
    assert ticket.label == "key-" + hashlib.sha256(b"sk-secret").hexdigest()[:12]
    with pytest.raises(HttpError) as info:
        tenants.admit(_scope(key="sk-secret"))
    assert "sk-secret" not in info.value.message and ticket.label in info.value.message
    assert _tenants(TenantLimit()).admit(_scope()).label == ANONYMOUS


@pytest.mark.parametrize("bad", ["", "-x", "a b", "x" * 65, "é"])
def test_a_bad_tenant_header_is_a_400(bad):
    with pytest.raises(HttpError) as info:
        _tenants(TenantLimit()).admit(_scope(bad))
    assert info.value.status == 400 and info.value.param == "x-dynamo-tenant"


# -- the limits file ----------------------------------------------------------------------


def test_limits_file_format():
    table = parse_limits("""
        [default]
        requests_per_second = 2.5
        tokens_per_minute = 1000

        [tenants.team-a]
        requests_per_second = 10
        burst = 30
        keys = ["sk-a1", "sk-a2"]

        [tenants.key-0123456789ab]
        tokens_per_minute = 5
    """)
    assert table.default == TenantLimit(2.5, 3, 1000)  # burst: the rate, rounded up
    assert table.limit("team-a") == TenantLimit(10.0, 30, None)
    assert table.limit("someone") == table.default
    assert table.key_name(b"sk-a2") == "team-a"
    assert table.key_name(b"sk-other") == key_label(b"sk-other")
    assert table.limit("key-0123456789ab").tokens_per_minute == 5
    assert parse_limits("").default == TenantLimit()  # no default: unlisted are unlimited


@pytest.mark.parametrize(("text", "says"), [
    ("[default]\nrequests_per_second = 0", "must be > 0"),
    ("[default]\nrequests_per_second = 'fast'", "must be a number"),
    ("[default]\ntokens_per_minute = 10.5", "whole number"),
    ("[default]\nburst = 3", "burst needs requests_per_second"),
    ("[default]\nrequest_per_second = 1", "unknown field"),
    ("[default]\nkeys = ['k']", "unknown field"),
    ("[tenant.a]\ntokens_per_minute = 1", "unknown top-level"),
    ("[tenants.'a b']\ntokens_per_minute = 1", "tenant name"),
    ("[tenants.a]\nkeys = ['k']\n[tenants.b]\nkeys = ['k']", "also a key of [tenants.a]"),
    ("[default\n", "not valid TOML"),
])
def test_limits_file_errors(text, says):
    with pytest.raises(errors.InvalidArgument) as info:
        parse_limits(text)
    assert says in info.value.message


def test_http_workers_share_the_rates_not_the_sizes():
    """With --http-workers 2 each process refills at half the file's rates; its buckets hold
    the file's sizes (a request that fits the budget fits any one process)."""
    now = [0.0]
    limit = TenantLimit(requests_per_second=1.0, burst=1, tokens_per_minute=600)
    tenants = Tenants(_Limits(LimitTable(default=limit)), False, CollectorRegistry(), share=2,
                      clock=lambda: now[0])
    ticket = tenants.admit(_scope("a"))
    requests, tokens = ticket.tenant.requests, ticket.tenant.tokens
    assert (requests.rate, requests.capacity) == (0.5, 1)
    assert (tokens.rate, tokens.capacity) == (5.0, 600)
    ticket.reserve(100, 500)  # the whole budget fits one process
    with pytest.raises(HttpError) as info:
        tenants.admit(_scope("a"))
    assert info.value.retry_after == 2 and "1/2 per HTTP process" in info.value.message


def test_unlisted_header_tenants_share_one_label_past_the_cap(monkeypatch):
    """Clients choose header names: past MAX_LABELS of them the metrics say ``_other``
    (each keeps its own budget); listed tenants and ``anonymous`` keep their names."""
    monkeypatch.setattr("dynamo_zmq.frontend._tenants.MAX_LABELS", 2)
    limits = _Limits(LimitTable(default=TenantLimit(requests_per_second=0.01, burst=1),
                                tenants={"listed": TenantLimit()}))
    tenants = Tenants(limits, False, CollectorRegistry(), clock=lambda: 0.0)
    labels = [tenants.admit(_scope(name)).label for name in ("a", "b", "c", "key-x", "listed")]
    assert labels == ["a", "b", "_other", "_other", "listed"]
    assert tenants.admit(_scope()).label == ANONYMOUS
    with pytest.raises(HttpError):  # "c" has a budget of its own, spent
        tenants.admit(_scope("c"))
    tenants.admit(_scope("d"))
