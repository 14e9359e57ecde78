"""The router's wait queue in priority order (``router.busy.AdmissionQueue``), real objects: the
order in which waiters are admitted equals a brute-force model's sort (priority, then deadline,
no deadline last, then arrival) under random arrivals, releases, cancellations and a full queue
(where a higher-priority arrival evicts the last waiter and any other arrival is refused)."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_zmq import errors
from dynamo_zmq.context import Context
from router.busy import AdmissionQueue
from router.metrics import RouterMetrics
from tests.support.metrics import first_sample


async def settle() -> None:
    """Run the loop until every ready task has run (no I/O and no timer is involved)."""
    for _ in range(20):
        await asyncio.sleep(0)


@dataclass
class Model:
    """The queue as a sorted list, brute force: what should be admitted, evicted, refused."""

    max_size: int
    capacity: int = 0
    waiting: list[tuple[tuple[int, float, int], int]] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)
    evicted: set[int] = field(default_factory=set)
    refused: set[int] = field(default_factory=set)
    cancelled: set[int] = field(default_factory=set)

    def arrive(self, rid: int, priority: int, deadline: float | None) -> None:
        if not self.waiting and self.capacity > 0:
            self.capacity -= 1
            self.admitted.append(rid)
            return
        if len(self.waiting) >= self.max_size:
            last = max(self.waiting) if self.waiting else None
            if last is None or last[0][0] <= priority:
                self.refused.add(rid)
                return
            self.waiting.remove(last)
            self.evicted.add(last[1])
        key = (priority, math.inf if deadline is None else deadline, rid)
        self.waiting.append((key, rid))

    def release(self) -> None:
        if self.waiting:
            first = min(self.waiting)
            self.waiting.remove(first)
            self.admitted.append(first[1])
        else:
            self.capacity += 1

    def cancel(self, pick: int) -> int | None:
        if not self.waiting:
            return None
        key, rid = sorted(self.waiting)[pick % len(self.waiting)]
        self.waiting.remove((key, rid))
        self.cancelled.add(rid)
        return rid


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.integers(-2, 2),
                  st.one_of(st.none(), st.integers(0, 4).map(float))),
        st.tuples(st.just("release"), st.just(0), st.none()),
        st.tuples(st.just("cancel"), st.integers(0, 10), st.none()),
    ),
    max_size=40,
)


async def _play(max_size: int, ops: list[tuple[str, int, float | None]]) -> None:
    metrics = RouterMetrics()
    queue = AdmissionQueue(max_size, max_wait=1000, metrics=metrics, model="m")
    model = Model(max_size)
    capacity = 0
    admitted: list[int] = []
    outcome: dict[int, type[BaseException]] = {}
    contexts: dict[int, Context] = {}
    tasks = []

    async def request(rid: int, priority: int, deadline: float | None) -> None:
        nonlocal capacity
        try:
            await queue.admit(lambda: capacity > 0, contexts[rid], priority, deadline)
        except (errors.Overloaded, errors.Cancelled) as exc:
            outcome[rid] = type(exc)
            return
        capacity -= 1  # routed: takes the slot (no await in between, as KvRouter does)
        admitted.append(rid)

    for rid, (op, value, deadline) in enumerate(ops):
        if op == "arrive":
            contexts[rid] = Context()
            model.arrive(rid, value, deadline)
            tasks.append(asyncio.create_task(request(rid, value, deadline)))
        elif op == "release":
            model.release()
            capacity += 1
            queue.notify()
        else:
            gone = model.cancel(value)
            if gone is not None:
                contexts[gone].stop()
        await settle()
        assert admitted == model.admitted
        assert len(queue) == len(model.waiting)
    assert {r for r, e in outcome.items() if e is errors.Cancelled} == model.cancelled
    assert {r for r, e in outcome.items() if e is errors.Overloaded} == (
        model.refused | model.evicted)
    waiting = len(model.waiting)
    for _ in range(waiting):  # the rest go in the model's order too
        model.release()
        capacity += 1
        queue.notify()
        await settle()
    assert admitted == model.admitted and len(queue) == 0
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    page = metrics.render().decode()
    assert (first_sample(page, "dynamo_router_busy_queued_requests", model="m") or 0) == 0
    rejected = first_sample(page, "dynamo_router_busy_rejected_total", model="m")
    assert (rejected or 0) == len(model.refused | model.evicted)


@settings(max_examples=150, deadline=None)
@given(max_size=st.integers(0, 5), ops=OPS)
def test_waiters_are_admitted_in_the_models_order(max_size, ops) -> None:
    asyncio.run(_play(max_size, ops), debug=True)


async def test_priority_beats_deadline_beats_arrival_and_a_full_queue_evicts_the_last() -> None:
    """The documented order and full-queue rule, one case each (the property above covers the
    mixes)."""
    queue = AdmissionQueue(3, max_wait=1000, metrics=RouterMetrics(), model="m")
    capacity = 0
    order: list[str] = []
    results: dict[str, BaseException | None] = {}
    tasks: list[asyncio.Task[None]] = []

    async def request(name: str, priority: int, deadline: float | None) -> None:
        nonlocal capacity
        try:
            await queue.admit(lambda: capacity > 0, None, priority, deadline)
        except errors.Overloaded as exc:
            results[name] = exc
            return
        capacity -= 1
        order.append(name)
        results[name] = None

    async def arrive(name: str, priority: int, deadline: float | None = None) -> None:
        tasks.append(asyncio.create_task(request(name, priority, deadline)))
        await settle()

    await arrive("late-default", 0)  # priority 0, no deadline
    await arrive("deadline-5", 0, 5.0)  # same priority, a deadline: before it
    await arrive("low", 3)  # a lower priority: after both
    assert len(queue) == 3
    await arrive("also-low", 3)  # full, and it does not outrank the last: refused
    assert isinstance(results["also-low"], errors.Overloaded)
    await arrive("urgent", -1)  # full, but it outranks the last: "low" is evicted
    assert isinstance(results["low"], errors.Overloaded)
    assert "higher priority" in str(results["low"])
    for _ in range(3):
        capacity += 1
        queue.notify()
        await settle()
    assert order == ["urgent", "deadline-5", "late-default"]
    await asyncio.wait_for(asyncio.gather(*tasks), 10)


def test_an_empty_full_queue_refuses_any_priority() -> None:
    queue = AdmissionQueue(0, max_wait=1, metrics=RouterMetrics(), model="m")
    with pytest.raises(errors.Overloaded):
        asyncio.run(queue.admit(lambda: False, None, priority=-100))
