"""The stop-string matcher (an Aho-Corasick automaton) against the quadratic algorithm it
replaced, delta by delta, and its cost on long stop strings."""

from __future__ import annotations

import tracemalloc
from collections.abc import Sequence

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamo_zmq.llm import MAX_STOP_LENGTH, MAX_STOP_STRINGS, StopStringMatcher, stop_bounds_error

PROPS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Reference:
    """The matcher as it was: every prefix of every stop string in a set (quadratic in their
    length), a ``find`` per stop string per delta. A fine oracle for short strings."""

    def __init__(self, stops: Sequence[str], include_stop_str: bool = False) -> None:
        self.stops = tuple(dict.fromkeys(s for s in stops if s))
        self._include = include_stop_str
        self._prefixes = frozenset(s[:k] for s in self.stops for k in range(1, len(s)))
        self._max_hold = max((len(s) for s in self.stops), default=1) - 1
        self._buf = ""
        self.matched: str | None = None

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.matched is not None:
            return "", True
        buf = self._buf + delta
        best: tuple[int, int] | None = None
        for stop in self.stops:
            start = buf.find(stop)
            if start >= 0:
                key = (start + len(stop), start)
                if best is None or key < best:
                    best, self.matched = key, stop
        if best is not None:
            self._buf = ""
            return buf[: best[0] if self._include else best[1]], True
        hold = next(
            (k for k in range(min(len(buf), self._max_hold), 0, -1)
             if buf[-k:] in self._prefixes),
            0,
        )
        self._buf = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        text, self._buf = self._buf, ""
        return text


ALPHABET = st.sampled_from(["a", "b", "c", "\n", "é", "日", "🙂"])
#: One step of a stream: feed a delta, or flush (as ``PostProcessor`` does under min_tokens).
STEP = st.one_of(st.text(ALPHABET, max_size=8), st.none())


@PROPS
@given(
    stops=st.lists(st.text(ALPHABET, max_size=7), max_size=6),
    steps=st.lists(STEP, max_size=25),
    include=st.booleans(),
)
def test_matcher_agrees_with_the_quadratic_reference_delta_by_delta(
    stops: list[str], steps: list[str | None], include: bool
) -> None:
    new, old = StopStringMatcher(stops, include), Reference(stops, include)
    assert new.stops == old.stops
    for step in steps:
        if step is None:
            assert new.flush() == old.flush()
        else:
            assert new.feed(step) == old.feed(step)
        assert new.matched == old.matched
    assert new.flush() == old.flush()


@PROPS
@given(
    stop=st.text(st.sampled_from("ab"), min_size=1, max_size=12),
    text=st.text(st.sampled_from("ab"), max_size=60),
    size=st.integers(1, 5),
)
def test_self_overlapping_stops_agree_with_the_reference(stop: str, text: str, size: int) -> None:
    # Periodic stop strings ("abab...") exercise the failure links hardest.
    stops = [stop, stop[: len(stop) // 2], stop * 2]
    new, old = StopStringMatcher(stops), Reference(stops)
    for i in range(0, len(text), size):
        assert new.feed(text[i : i + size]) == old.feed(text[i : i + size])
    assert new.flush() == old.flush()


def test_a_stop_string_at_the_bound_costs_memory_linear_in_its_length() -> None:
    # The old matcher kept every prefix: ~L^2 / 2 characters (8 MB for L = 4096, 770 MB at 40k).
    stops = ["A" * (MAX_STOP_LENGTH - 1) + chr(0x100 + i) for i in range(MAX_STOP_STRINGS)]
    tracemalloc.start()
    try:
        matcher = StopStringMatcher(stops)
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert used < 500 * MAX_STOP_LENGTH  # a few hundred bytes per automaton state
    text, matched = matcher.feed("A" * (MAX_STOP_LENGTH - 1))
    assert (text, matched) == ("", False)
    assert matcher.feed("x" + "A" * (MAX_STOP_LENGTH - 1) + chr(0x103)) == ("A" * 4095 + "x", True)
    assert matcher.matched == stops[3]


def test_stop_bounds() -> None:
    assert stop_bounds_error(["x"] * MAX_STOP_STRINGS) is None
    assert stop_bounds_error(["x" * MAX_STOP_LENGTH]) is None
    assert "at most 16" in str(stop_bounds_error(["x"] * (MAX_STOP_STRINGS + 1)))
    assert "4096 characters" in str(stop_bounds_error(["x" * (MAX_STOP_LENGTH + 1)]))
