"""A token bucket with reservations: the arithmetic of the per-tenant limits (``_tenants.py``).

The bucket holds at most ``capacity`` and refills at ``rate`` per second. ``take`` admits an
amount if the bucket holds it (nothing is taken otherwise, and it says how long until it
would fit); ``give`` returns part of an earlier take (a reservation that was not used), never
past ``capacity``; ``charge`` takes more than was reserved, the bucket going into debt if need
be. Time is passed in (``now``, seconds on a monotonic clock), so the arithmetic is testable
on its own.
"""

from __future__ import annotations

import math

__all__ = ["TokenBucket"]


class TokenBucket:
    """See the module docstring. A new bucket is full."""

    __slots__ = ("capacity", "level", "rate", "stamp")

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self.level = capacity
        self.stamp = now

    def __repr__(self) -> str:
        return f"TokenBucket(rate={self.rate:g}, capacity={self.capacity:g}, level={self.level:g})"

    def refill(self, now: float) -> None:
        """Add what the time since the last look brought, up to ``capacity``."""
        if now > self.stamp:
            if self.level < self.capacity:
                self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
            self.stamp = now

    def wait(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` fits (0: now; ``inf``: never, more than ``capacity``)."""
        if amount > self.capacity:
            return math.inf
        self.refill(now)
        missing = amount - self.level
        return 0.0 if missing <= 0 else missing / self.rate

    def take(self, amount: float, now: float) -> float:
        """Take ``amount`` if it fits now and return 0; else take nothing and return the
        seconds until it would fit (``inf``: never)."""
        wait = self.wait(amount, now)
        if wait == 0.0:
            self.level -= amount
        return wait

    def give(self, amount: float, now: float) -> None:
        """Return ``amount`` (>= 0) of an earlier take, up to ``capacity``."""
        self.refill(now)
        self.level = min(self.capacity, self.level + amount)

    def charge(self, amount: float, now: float) -> None:
        """Take ``amount`` (>= 0) whatever the level (a debt is paid off by the refill)."""
        self.refill(now)
        self.level -= amount

    def full(self, now: float) -> bool:
        """Whether the bucket is full (then it is no different from a new one)."""
        self.refill(now)
        return self.level >= self.capacity

    def reconfigure(self, rate: float, capacity: float, now: float) -> None:
        """New limits: the level so far is kept, up to the new ``capacity``."""
        self.refill(now)
        self.rate, self.capacity = rate, capacity
        self.level = min(self.level, capacity)
