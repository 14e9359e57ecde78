"""``dynamo_zmq.histogram.Histogram`` exposes exactly what ``prometheus_client.Histogram``
does for the same observations (its ``_created`` series aside), so swapping one for the other
changes no dashboard or query."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import Histogram as PromHistogram

from dynamo_zmq.histogram import Histogram

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def exposition(registry: CollectorRegistry) -> list[str]:
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if "_created" not in line]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.one_of(st.sampled_from(BUCKETS),
                      st.floats(min_value=0, max_value=100, allow_nan=False)),
        ),
        max_size=60,
    )
)
def test_same_exposition_as_prometheus_client(observations: list[tuple[str, float]]) -> None:
    ours_reg, theirs_reg = CollectorRegistry(), CollectorRegistry()
    ours = Histogram("itl_seconds", "Time between chunks", ["model", "worker"],
                     buckets=BUCKETS, registry=ours_reg)
    theirs = PromHistogram("itl_seconds", "Time between chunks", ["model", "worker"],
                           buckets=BUCKETS, registry=theirs_reg)
    for model, value in observations:
        ours.labels(model, "w1").observe(value)
        theirs.labels(model, "w1").observe(value)
    assert exposition(ours_reg) == exposition(theirs_reg)


def test_a_value_on_a_bound_counts_in_that_bucket_and_bad_buckets_are_refused() -> None:
    registry = CollectorRegistry()
    h = Histogram("x_seconds", "x", ["m"], buckets=(0.5, 1.0), registry=registry)
    child = h.labels("m")
    for value in (0.5, 1.0, 1.5):
        child.observe(value)
    assert child.counts == [1, 1, 1] and child.total == 3.0
    assert registry.get_sample_value("x_seconds_bucket", {"m": "m", "le": "0.5"}) == 1
    assert registry.get_sample_value("x_seconds_count", {"m": "m"}) == 3
    with pytest.raises(ValueError, match="increasing"):
        Histogram("y", "y", ["m"], buckets=(1.0, 0.5))
    with pytest.raises(ValueError, match="label values"):
        h.labels("m", "extra")
