"""Bad input from peers: counted by kind, logged as at most one line per kind per interval.

A peer that sends garbage (malformed frames, undecodable payloads, out-of-range values) must
not be able to flood the log: each kind logs its first occurrence, then at most one line every
``LOG_EVERY`` seconds, which says how many more were suppressed meanwhile. Every occurrence is
counted (``counts``); ``bad_input_totals()`` sums the counts of every ``BadInput`` of the
process, by kind, for its Prometheus counter (the worker's
``dynamo_component_malformed_input_total``). Never a traceback: bad input is the peer's fault,
not ours.
"""

from __future__ import annotations

import logging
import time
import weakref

__all__ = ["LOG_EVERY", "BadInput", "bad_input_totals"]

#: Seconds between two log lines of one kind of bad input.
LOG_EVERY = 10.0


class BadInput:
    """Counts and rate-limits the log lines of bad input, by kind.

    Args:
        logger: where the lines go (WARNING).
        every: seconds between two lines of one kind.
    """

    __slots__ = ("__weakref__", "_every", "_last", "_log", "_suppressed", "counts")

    def __init__(self, logger: logging.Logger, every: float = LOG_EVERY) -> None:
        self._log = logger
        self._every = every
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        #: Occurrences so far, by kind.
        self.counts: dict[str, int] = {}
        _ALL.add(self)
        weakref.finalize(self, _retire, self.counts)  # a counter never goes down

    def note(self, kind: str, msg: str, *args: object) -> None:
        """Count one occurrence of ``kind``; log ``msg % args`` unless one of its kind was
        logged less than ``every`` seconds ago."""
        self.counts[kind] = self.counts.get(kind, 0) + 1
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self._every:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return
        self._last[kind] = now
        more = self._suppressed.pop(kind, 0)
        if more:
            self._log.warning(
                msg + " (and %d more %s since the last such line)", *args, more, kind
            )
        else:
            self._log.warning(msg, *args)


_ALL: weakref.WeakSet[BadInput] = weakref.WeakSet()
#: The counts of ``BadInput`` objects already collected.
_RETIRED: dict[str, int] = {}


def _retire(counts: dict[str, int]) -> None:
    for kind, n in counts.items():
        _RETIRED[kind] = _RETIRED.get(kind, 0) + n


def bad_input_totals() -> dict[str, int]:
    """Occurrences of bad input so far in this process, by kind, over every live ``BadInput``."""
    totals = dict(_RETIRED)
    for source in list(_ALL):
        for kind, n in source.counts.items():
            totals[kind] = totals.get(kind, 0) + n
    return totals
