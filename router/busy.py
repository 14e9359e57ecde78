"""Busy workers: when a (worker, rank) takes no new request, and where requests wait meanwhile.

A candidate is busy when its predicted active KV blocks (``LoadTracker.load``: the worker's
report plus what was routed since) exceed ``kv_threshold`` of the blocks it has in all (known
from its load reports; unknown: never busy by KV), or when the prompt tokens routed to it and
not yet prefilled (no first output yet; ``PrefillTokens``) exceed ``prefill_tokens``. The check
reads the load before the new request is added, so an idle worker is never busy, whatever the
prompt. The router routes among the non-busy candidates; when every one is busy the request
waits in an ``AdmissionQueue`` (first in, first out, bounded in count and in time), and past
either bound gets ``errors.Overloaded`` (the frontend's 503 with ``Retry-After``).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
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
    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = asyncio.Event()


class AdmissionQueue:
    """Requests waiting for a non-busy candidate, first in, first out.

    Args:
        max_size: requests that may wait at once (0: none wait, a busy cluster refuses at once).
        max_wait: seconds one request may wait.
        metrics: ``busy_queued``, ``busy_rejected`` and ``busy_wait``, labelled ``model``.
    """

    def __init__(
        self, max_size: int, max_wait: float, metrics: RouterMetrics, model: str
    ) -> None:
        self.max_size = max_size
        self.max_wait = max_wait
        self._metrics = metrics
        self._model = model
        self._waiters: deque[_Waiter] = deque()

    def __len__(self) -> int:
        return len(self._waiters)

    def notify(self) -> None:
        """Capacity may have freed: the first waiter looks again."""
        if self._waiters:
            self._waiters[0].event.set()

    async def admit(self, free: Callable[[], bool], context: Context | None) -> None:
        """Return when the caller may route now: ``free()`` (some candidate is not busy) and no
        request waits before it. The caller must route without awaiting in between.

        Raises:
            Overloaded: the queue is full, or ``max_wait`` passed.
            Cancelled: ``context`` was stopped while waiting.
        """
        if not self._waiters and free():
            return
        m, model = self._metrics, self._model
        if len(self._waiters) >= self.max_size:
            m.busy_rejected.labels(model).inc()
            raise errors.Overloaded(
                f"every worker is busy and {self.max_size} requests already wait",
                retry_after=self.max_wait,
            )
        me = _Waiter()
        self._waiters.append(me)
        m.busy_queued.labels(model).inc()
        remove = None if context is None else context.add_listener(lambda _: me.event.set())
        started = time.monotonic()
        deadline = started + self.max_wait
        try:
            while True:
                if context is not None and context.is_stopped():
                    raise errors.Cancelled("stopped while waiting for a worker")
                if self._waiters[0] is me and free():
                    return
                left = deadline - time.monotonic()
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
            self._waiters.remove(me)
            m.busy_queued.labels(model).dec()
            m.busy_wait.labels(model).observe(time.monotonic() - started)
            self.notify()  # the next one may go too (it runs after this one has routed)
