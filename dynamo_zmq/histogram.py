"""A Prometheus histogram cheap enough to observe once per token.

``prometheus_client.Histogram.observe`` takes a lock and walks every bucket (about 2.5 µs); at
tens of thousands of tokens a second that is a few percent of a process's CPU. ``Histogram``
here is observed from one thread (the event loop) and read by the scrape: ``observe`` is one
``bisect`` and two additions, without a lock. A scrape that runs between the two additions
sees a count and a sum one observation apart, which Prometheus tolerates as it does any
scrape taken mid-update.

It registers as a collector and exposes the same samples (``_bucket``, ``_count``, ``_sum``)
under the same name and labels as ``prometheus_client.Histogram``, so dashboards and queries
do not change; use it only where observations come from a single thread.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

__all__ = ["Histogram", "HistogramChild"]


class HistogramChild:
    """One label set's buckets; ``observe`` is the hot call."""

    __slots__ = ("_bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        #: Observations per bucket, not cumulative; the last one is ``+Inf``.
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        """Count ``value`` in the first bucket whose upper bound is at least ``value``."""
        self.counts[bisect_left(self._bounds, value)] += 1
        self.total += value


class Histogram(Collector):
    """A labelled histogram with ``prometheus_client``'s interface for ``labels().observe``.

    Args:
        name: the metric name, without ``_bucket``/``_count``/``_sum``.
        documentation: the HELP text.
        labelnames: label names; ``labels()`` takes their values in this order.
        buckets: upper bounds in increasing order (``+Inf`` is added).
        registry: where to register (None: not registered).
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry | None = None,
    ) -> None:
        bounds = tuple(float(b) for b in buckets if b != float("inf"))
        if not bounds or list(bounds) != sorted(set(bounds)):
            raise ValueError(f"histogram {name}: buckets must be increasing, got {buckets!r}")
        self._name = name
        self._doc = documentation
        self._labelnames = tuple(labelnames)
        self._bounds = bounds
        self._children: dict[tuple[str, ...], HistogramChild] = {}
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str) -> HistogramChild:
        """The child for one label set (created on first use; resolve it once, off the hot
        path, as with ``prometheus_client``)."""
        if len(values) != len(self._labelnames):
            raise ValueError(f"histogram {self._name}: expected {len(self._labelnames)} label "
                             f"values, got {len(values)}")
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = HistogramChild(self._bounds)
        return child

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)
        for key, child in list(self._children.items()):
            counts, total = list(child.counts), child.total
            buckets, running = [], 0
            for bound, n in zip((*self._bounds, float("inf")), counts, strict=True):
                running += n
                buckets.append((floatToGoString(bound), running))  # type: ignore[no-untyped-call]
            family.add_metric(list(key), buckets, total)
        yield family

