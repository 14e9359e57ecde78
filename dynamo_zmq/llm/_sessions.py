"""Session affinity: which worker (and data-parallel rank) served each session last.

A request may name its session (``RouteOptions.session_id``, the frontend's
``X-Dynamo-Session-ID``). A router that pins sessions asks its ``SessionPins`` where the session
went last (``get``) and prefers that (worker, rank) while it is live, allowed and not busy; it
then tells the table where the request went and why (``routed``): to its pin (``pinned``), a
first request (``new``), or elsewhere because the pinned worker was ``busy`` or ``lost`` (gone,
excluded, not allowed). The session then belongs to the worker it went to.

A pin lives ``ttl`` seconds after the session's last request. The table holds at most
``max_sessions`` pins: beyond, the least recently used go first (``evicted``), so a client that
sends a fresh id per request costs bounded memory. Pins other routers made (router replica
sync) are ``learn``ed without counting as routed here.

Metrics (``SessionMetrics``, one set per registry, labelled ``model``):
``dynamo_router_session_pinned_total``, ``..._new_total``, ``..._moved_total{reason}``,
``..._expired_total``, ``..._evicted_total`` and the gauge ``dynamo_router_sessions`` (live
pins, expired ones swept at each scrape).
"""

from __future__ import annotations

import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric

__all__ = [
    "BUSY",
    "DEFAULT_MAX_SESSIONS",
    "DEFAULT_SESSION_TTL",
    "LOST",
    "NEW",
    "NO_SESSIONS",
    "PINNED",
    "SessionConfig",
    "SessionMetrics",
    "SessionPins",
    "pin_outcome",
]

#: Seconds a session stays pinned after its last request.
DEFAULT_SESSION_TTL = 300.0
#: Most sessions one router pins at once (the least recently used go beyond).
DEFAULT_MAX_SESSIONS = 100_000

#: Where a session's request went: to its pinned (worker, rank), a session not pinned (yet, or
#: any more), or elsewhere since the pinned one was busy, or gone (not live, excluded, not
#: allowed).
PINNED, NEW, BUSY, LOST = "pinned", "new", "busy", "lost"
#: (worker instance id, data-parallel rank)
Candidate = tuple[int, int]


@dataclass(frozen=True)
class SessionConfig:
    """How a router pins sessions (the frontend's ``--session-ttl`` and ``--max-sessions``)."""

    #: Seconds a pin lives after the session's last request; 0: no pinning.
    ttl: float = DEFAULT_SESSION_TTL
    #: Most pins held; the least recently used are evicted beyond.
    max_sessions: int = DEFAULT_MAX_SESSIONS

    @property
    def enabled(self) -> bool:
        return self.ttl > 0 and self.max_sessions > 0


#: Pinning off (a prefill pool's router: its requests name no session).
NO_SESSIONS = SessionConfig(ttl=0.0)


def pin_outcome(pinned: Candidate | None, chosen: Candidate, eligible: Callable[[], bool]
                ) -> str:
    """Why a session's request went to ``chosen``: ``NEW`` without a pin, ``PINNED`` to it,
    else ``BUSY`` if the pinned one was ``eligible`` (live, not excluded, allowed) or ``LOST``."""
    if pinned is None:
        return NEW
    if chosen == pinned:
        return PINNED
    return BUSY if eligible() else LOST


def _gauge() -> GaugeMetricFamily:
    return GaugeMetricFamily("dynamo_router_sessions", "Sessions pinned now", labels=["model"])


class SessionMetrics:
    """The ``dynamo_router_session*`` series of one registry (``for_registry``). The live-pin
    gauge is collected first, sweeping each table's expired pins, so a scrape's counters
    include what that sweep expired."""

    _by_registry: weakref.WeakKeyDictionary[CollectorRegistry, SessionMetrics] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self, registry: CollectorRegistry) -> None:
        r, m = registry, ["model"]
        self._tables: weakref.WeakSet[SessionPins] = weakref.WeakSet()
        r.register(self)  # first: its sweep runs before the counters are read
        self.pinned = Counter("dynamo_router_session_pinned",
                              "Session requests routed to their session's worker", m, registry=r)
        self.new = Counter("dynamo_router_session_new",
                           "Session requests of a session not pinned (first, or expired)", m,
                           registry=r)
        self.moved = Counter("dynamo_router_session_moved",
                             "Session requests routed away from their session's worker, by "
                             "reason (busy, lost)", [*m, "reason"], registry=r)
        self.expired = Counter("dynamo_router_session_expired",
                               "Sessions unpinned after --session-ttl without a request", m,
                               registry=r)
        self.evicted = Counter("dynamo_router_session_evicted",
                               "Sessions unpinned beyond --max-sessions (least recently used)",
                               m, registry=r)

    @classmethod
    def for_registry(cls, registry: CollectorRegistry) -> SessionMetrics:
        found = cls._by_registry.get(registry)
        if found is None:
            found = cls._by_registry[registry] = cls(registry)
        return found

    def follow(self, table: SessionPins) -> None:
        self._tables.add(table)

    def describe(self) -> list[Metric]:
        return [_gauge()]

    def collect(self) -> Iterator[Metric]:
        live: dict[str, int] = {}
        for table in list(self._tables):
            table.sweep()
            live[table.model] = live.get(table.model, 0) + len(table)
        family = _gauge()
        for model, n in sorted(live.items()):
            family.add_metric([model], n)
        yield family


class SessionPins:
    """Each session's (worker, rank) and last use, least recently used first.

    Args:
        config: the TTL and the cap.
        model: the metrics label.
        registry: where the metrics go (a private registry when None).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, config: SessionConfig | None = None, *, model: str = "",
                 registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or SessionConfig()
        self.ttl, self.cap = self.config.ttl, self.config.max_sessions
        self.model = model
        self._clock = clock
        #: session -> (candidate, last use), oldest last use first.
        self._pins: OrderedDict[str, tuple[Candidate, float]] = OrderedDict()
        self._m = SessionMetrics.for_registry(registry if registry is not None
                                              else CollectorRegistry())
        self._m.follow(self)

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def __len__(self) -> int:
        return len(self._pins)

    def __contains__(self, session: str) -> bool:
        return session in self._pins

    def get(self, session: str | None) -> Candidate | None:
        """Where ``session`` went last, if pinned and not expired (None also when pinning is
        off or there is no session)."""
        if session is None or not self.enabled:
            return None
        self.sweep()
        found = self._pins.get(session)
        return None if found is None else found[0]

    def routed(self, session: str, candidate: Candidate, outcome: str) -> None:
        """``session``'s request went to ``candidate`` (``outcome``: ``pin_outcome``'s): count
        it and pin the session there from now."""
        if not self.enabled:
            return
        self.sweep()
        m, model = self._m, self.model
        if outcome == PINNED:
            m.pinned.labels(model).inc()
        elif outcome == NEW:
            m.new.labels(model).inc()
        else:
            m.moved.labels(model, outcome).inc()
        self._put(session, candidate, self._clock())

    def learn(self, session: str, candidate: Candidate, age: float = 0.0) -> None:
        """Another router's pin of ``session``, last used ``age`` seconds ago; kept unless this
        table's is more recent or it has expired."""
        self.learn_many([(session, candidate, age)])

    def learn_many(self, pins: Iterable[tuple[str, Candidate, float]]) -> None:
        """``learn`` each of ``pins`` (a peer's snapshot)."""
        if not self.enabled:
            return
        self.sweep()
        now = self._clock()
        newest = self._newest()
        reorder = False
        for session, candidate, age in pins:
            at = now - max(0.0, age)
            known = self._pins.get(session)
            if at <= now - self.ttl or (known is not None and known[1] >= at):
                continue
            reorder = reorder or at < newest
            self._pins[session] = (candidate, at)
            self._pins.move_to_end(session)
            newest = max(newest, at)
        if reorder:  # keep least recently used first
            self._pins = OrderedDict(sorted(self._pins.items(), key=lambda kv: kv[1][1]))
        self._evict()

    def snapshot(self) -> list[tuple[str, int, int, float]]:
        """Every live pin as (session, worker, rank, seconds since its last use)."""
        self.sweep()
        now = self._clock()
        return [(s, w, r, now - at) for s, ((w, r), at) in self._pins.items()]

    def sweep(self) -> int:
        """Unpin the sessions unused for ``ttl`` seconds; how many."""
        horizon = self._clock() - self.ttl
        n = 0
        while self._pins:
            session, (_, at) = next(iter(self._pins.items()))
            if at > horizon:
                break
            del self._pins[session]
            n += 1
        if n:
            self._m.expired.labels(self.model).inc(n)
        return n

    def clear(self) -> None:
        """Forget every pin (the router is closing)."""
        self._pins.clear()

    def _put(self, session: str, candidate: Candidate, at: float) -> None:
        self._pins[session] = (candidate, at)
        self._pins.move_to_end(session)
        self._evict()

    def _evict(self) -> None:
        n = len(self._pins) - self.cap
        for _ in range(max(0, n)):
            self._pins.popitem(last=False)
        if n > 0:
            self._m.evicted.labels(self.model).inc(n)

    def _newest(self) -> float:
        if not self._pins:
            return -float("inf")
        return self._pins[next(reversed(self._pins))][1]
