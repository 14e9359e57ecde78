"""Read samples from a Prometheus text page (a worker's or a frontend's ``/metrics``)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def sample(page: str, name: str, **labels: str) -> float | None:
    """The value of sample ``name`` whose labels include ``labels``; None if there is none.
    The sum when several match (e.g. a counter over an extra label)."""
    found = [
        s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    return sum(found) if found else None
