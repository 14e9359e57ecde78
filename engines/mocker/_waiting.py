"""The waiting queue of a mocker rank, by scheduling policy (vLLM's ``--scheduling-policy``).

``fcfs`` (the default) is a plain deque: arrival order, a preempted sequence back in front.
``priority`` orders by ``(priority, arrival)`` (lower priority first), as vLLM's priority
policy does; a preempted sequence goes back in at its own place (it keeps its arrival).
Both answer what the scheduler uses: ``append``, ``appendleft``, ``popleft``, ``remove``,
``[0]``, ``len``, iteration and ``clear``.
"""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Iterator

from ._sequence import Sequence

__all__ = ["POLICIES", "PriorityWaiting", "Waiting", "waiting_queue"]

#: The scheduling policies (vLLM's names).
POLICIES = ("fcfs", "priority")


class PriorityWaiting:
    """Waiting sequences, lowest ``(priority, arrival)`` first (a heap)."""

    __slots__ = ("_arrivals", "_heap")

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Sequence]] = []
        self._arrivals = itertools.count()

    def append(self, seq: Sequence) -> None:
        """A new sequence: it arrives now."""
        seq.arrival = next(self._arrivals)
        heapq.heappush(self._heap, (seq.priority, seq.arrival, seq))

    def appendleft(self, seq: Sequence) -> None:
        """A preempted sequence: back at its place (its own priority and arrival)."""
        heapq.heappush(self._heap, (seq.priority, seq.arrival, seq))

    def popleft(self) -> Sequence:
        return heapq.heappop(self._heap)[2]

    def remove(self, seq: Sequence) -> None:
        for i, entry in enumerate(self._heap):
            if entry[2] is seq:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError("the sequence is not waiting")

    def __getitem__(self, index: int) -> Sequence:
        if index == 0 and self._heap:
            return self._heap[0][2]
        return sorted(self._heap)[index][2]

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Sequence]:
        return (entry[2] for entry in sorted(self._heap))

    def clear(self) -> None:
        self._heap.clear()


Waiting = collections.deque[Sequence] | PriorityWaiting


def waiting_queue(policy: str) -> Waiting:
    """An empty waiting queue for ``policy`` (one of ``POLICIES``)."""
    if policy == "priority":
        return PriorityWaiting()
    if policy == "fcfs":
        return collections.deque()
    raise ValueError(f"scheduling policy must be one of {POLICIES}, got {policy!r}")
