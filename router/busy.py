"""Busy workers: when a (worker, rank) takes no new request, and where requests wait meanwhile.

A candidate is busy when its predicted active KV blocks (``LoadTracker.load``: the worker's
report plus what was routed since) exceed ``kv_threshold`` of the blocks it has in all (known
from its load reports; unknown: never busy by KV), or when the prompt tokens routed to it and
not yet prefilled (no first output yet; ``PrefillTokens``) exceed ``prefill_tokens``. The check
reads the load before the new request is added, so an idle worker is never busy, whatever the
prompt. The router routes among the non-busy candidates; when every one is busy the request
waits in an ``AdmissionQueue`` (ordered by priority, then deadline, then arrival; bounded in
count and in time), and past either bound gets ``errors.Overloaded`` (the frontend's 503 with
``Retry-After``).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
import time
from collections.abc import Callable

from dynamo_zmq import errors
from dynamo_zmq.context import Context
from dynamo_zmq.resources import wait_event

from .metrics import RouterMetrics
from .scheduler import Candidate, LoadTracker

__all__ = ["AdmissionQueue", "BusyPolicy", "PrefillTokens"]

#: Seconds between two checks of a waiting request's turn when nothing woke it (a report that
#: expired, a worker that joined: changes nobody announces).
POLL = 0.25


class PrefillTokens:
    """Prompt tokens routed to each candidate and not yet prefilled (the router's estimate)."""

    __slots__ = ("_tokens",)

    def __init__(self) -> None:
        self._tokens: dict[Candidate, int] = {}

    def add(self, candidate: Candidate, tokens: int) -> None:
        self._tokens[candidate] = self._tokens.get(candidate, 0) + tokens

    def done(self, candidate: Candidate, tokens: int) -> None:
        left = self._tokens.get(candidate, 0) - tokens
        if left > 0:
            self._tokens[candidate] = left
        else:
            self._tokens.pop(candidate, None)

    def get(self, candidate: Candidate) -> int:
        return self._tokens.get(candidate, 0)

    def remove_worker(self, worker_id: int) -> None:
        for key in [k for k in self._tokens if k[0] == worker_id]:
            del self._tokens[key]


class BusyPolicy:
    """Whether a candidate is busy (module docstring).

    Args:
        kv_threshold: fraction of a candidate's total KV blocks above which it is busy
            (0: never busy by KV).
        prefill_tokens: not-yet-prefilled prompt tokens above which it is busy (0: no bound).
    """

    def __init__(self, kv_threshold: float = 0.0, prefill_tokens: int = 0) -> None:
        if not 0 <= kv_threshold:  # (also refuses NaN)
            raise ValueError(f"kv_threshold must be >= 0, got {kv_threshold}")
        if prefill_tokens < 0:
            raise ValueError(f"prefill_tokens must be >= 0, got {prefill_tokens}")
        self.kv_threshold = kv_threshold
        self.prefill_tokens = prefill_tokens
        #: Whether any bound is set (nothing is checked per request otherwise).
        self.enabled = kv_threshold > 0 or prefill_tokens > 0

    def is_busy(
        self, candidate: Candidate, loads: LoadTracker, prefill: PrefillTokens,
        load: float | None = None,
    ) -> bool:
        """Whether ``candidate`` is busy (``load``: its ``loads.load``, when already read)."""
        if self.kv_threshold > 0:
            total = loads.total_blocks(candidate)
            if total:
                held = loads.load(candidate) if load is None else load
                if held > self.kv_threshold * total:
                    return True
        return 0 < self.prefill_tokens < prefill.get(candidate)


class _Waiter:
    __slots__ = ("event", "evicted", "key", "queued")

    def __init__(self, key: tuple[int, float, int]) -> None:
        self.event = asyncio.Event()
        #: (priority, deadline or +inf, arrival): the queue's order, smallest first.
        self.key = key
        self.queued = True
        #: A request of higher priority took its place in a full queue.
        self.evicted = False


def _key(waiter: _Waiter) -> tuple[int, float, int]:
    return waiter.key


class AdmissionQueue:
    """Requests waiting for a non-busy candidate, in order: priority (lower first), then
    deadline (earliest first; no deadline after every deadline), then arrival.

    When the queue is full, an arrival of strictly higher priority (a lower number) than the
    last waiter evicts that waiter (it gets ``Overloaded``) and takes a place; any other
    arrival is refused (``Overloaded``).

    Args:
        max_size: requests that may wait at once (0: none wait, a busy cluster refuses at once).
        max_wait: seconds one request may wait.
        metrics: ``busy_queued``, ``busy_rejected`` (refused, evicted or waited too long) and
            ``busy_wait``, labelled ``model``.
    """

    def __init__(
        self, max_size: int, max_wait: float, metrics: RouterMetrics, model: str
    ) -> None:
        self.max_size = max_size
        self.max_wait = max_wait
        self._metrics = metrics
        self._model = model
        #: Sorted by ``_Waiter.key``: the head is the next to go.
        self._waiters: list[_Waiter] = []
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._waiters)

    def notify(self) -> None:
        """Capacity may have freed: the first waiter looks again."""
        if self._waiters:
            self._waiters[0].event.set()

    def _drop(self, waiter: _Waiter) -> None:
        """Take ``waiter`` out of the queue (once)."""
        if waiter.queued:
            waiter.queued = False
            self._waiters.remove(waiter)
            self._metrics.busy_queued.labels(self._model).dec()

    def _make_room(self, priority: int) -> None:
        """A full queue: evict its last waiter for an arrival of higher ``priority``.

        Raises:
            Overloaded: the arrival does not outrank the last waiter (or nobody may wait).
        """
        last = self._waiters[-1] if self._waiters else None
        if last is None or last.key[0] <= priority:
            self._metrics.busy_rejected.labels(self._model).inc()
            raise errors.Overloaded(
                f"every worker is busy and {self.max_size} requests of the same or higher "
                "priority already wait",
                retry_after=self.max_wait,
            )
        self._drop(last)
        last.evicted = True
        last.event.set()

    async def admit(
        self, free: Callable[[], bool], context: Context | None, priority: int = 0,
        deadline: float | None = None,
    ) -> None:
        """Return when the caller may route now: ``free()`` (some candidate is not busy) and no
        request waits before it. The caller must route without awaiting in between.

        Args:
            free: whether some candidate is not busy now.
            context: the request's (stopping it ends the wait).
            priority: the request's priority (lower goes first).
            deadline: when the request's deadline passes (``time.monotonic()``; None: none).

        Raises:
            Overloaded: the queue is full (of waiters of the same or higher priority),
                ``max_wait`` passed, or a higher-priority arrival evicted it.
            Cancelled: ``context`` was stopped while waiting.
        """
        if not self._waiters and free():
            return
        m, model = self._metrics, self._model
        if len(self._waiters) >= self.max_size:
            self._make_room(priority)
        key = (priority, math.inf if deadline is None else deadline, next(self._arrivals))
        me = _Waiter(key)
        bisect.insort(self._waiters, me, key=_key)
        m.busy_queued.labels(model).inc()
        remove = None if context is None else context.add_listener(lambda _: me.event.set())
        started = time.monotonic()
        until = started + self.max_wait
        try:
            while True:
                if context is not None and context.is_stopped():
                    raise errors.Cancelled("stopped while waiting for a worker")
                if me.evicted:
                    m.busy_rejected.labels(model).inc()
                    raise errors.Overloaded(
                        "every worker is busy and a request of higher priority took this "
                        "one's place in the full wait queue",
                        retry_after=self.max_wait,
                    )
                if self._waiters[0] is me and free():
                    return
                left = until - time.monotonic()
                if left <= 0:
                    m.busy_rejected.labels(model).inc()
                    raise errors.Overloaded(
                        f"every worker stayed busy for {self.max_wait:g} s",
                        retry_after=self.max_wait,
                    )
                me.event.clear()
                await wait_event(me.event, min(POLL, left))
        finally:
            if remove is not None:
                remove()
            self._drop(me)
            m.busy_wait.labels(model).observe(time.monotonic() - started)
            self.notify()  # the next one may go too (it runs after this one has routed)
