"""Stop strings: the bounds a request's stop strings must keep, and the matcher that applies them.

``StopStringMatcher`` is an Aho-Corasick automaton over the request's stop strings, built once
per request in time and memory linear in their total length; each character fed costs amortized
O(1). Its state is the longest tail of the text that is a prefix of some stop string, which is
exactly the text held back, so the matcher keeps no text buffer of its own.

``MAX_STOP_STRINGS`` and ``MAX_STOP_LENGTH`` bound what one request may carry: the frontend answers
400 beyond them and the worker refuses such a request from any other caller (``check_stops``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

__all__ = ["MAX_STOP_LENGTH", "MAX_STOP_STRINGS", "StopStringMatcher", "stop_bounds_error"]

#: Most stop strings one request may carry (OpenAI allows 4; vLLM sets no bound).
MAX_STOP_STRINGS = 16
#: Longest stop string, in characters.
MAX_STOP_LENGTH = 4096


def stop_bounds_error(stops: Sequence[str]) -> str | None:
    """Why ``stops`` exceed the bounds (a message naming the bound), or None when they do not."""
    if len(stops) > MAX_STOP_STRINGS:
        return f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}"
    longest = max((len(s) for s in stops), default=0)
    if longest > MAX_STOP_LENGTH:
        return f"a stop string may be at most {MAX_STOP_LENGTH} characters, got {longest}"
    return None


class StopStringMatcher:
    """Cuts a text stream at the first stop string, never emitting part of one.

    ``feed`` holds back the longest tail of the text that is a proper prefix of some stop string
    (at most ``max(len(stop)) - 1`` characters). The first stop string to *complete* wins (on a
    tie, the longer one), so the result does not depend on how the text was split into deltas.

    Args:
        stops: the stop strings; empty ones are ignored.
        include_stop_str: emit the matched stop string too.
    """

    __slots__ = (
        "_depth", "_fail", "_first", "_goto", "_include", "_out", "_path", "_state",
        "matched", "stops",
    )

    def __init__(self, stops: Sequence[str], include_stop_str: bool = False) -> None:
        #: The distinct, non-empty stop strings.
        self.stops = tuple(dict.fromkeys(s for s in stops if s))
        self._include = include_stop_str
        # The trie: state 0 is the root; state s spells self.stops[_path[s]][:_depth[s]].
        goto: list[dict[str, int]] = [{}]
        depth, path, out = [0], [0], [-1]
        for i, stop in enumerate(self.stops):
            state = 0
            for ch in stop:
                nxt = goto[state].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[state][ch] = nxt
                    goto.append({})
                    depth.append(depth[state] + 1)
                    path.append(i)
                    out.append(-1)
                state = nxt
            out[state] = i
        # Failure links (breadth first); out[s] becomes the longest stop string ending at s.
        fail = [0] * len(goto)
        queue = deque(goto[0].values())
        while queue:
            state = queue.popleft()
            for ch, nxt in goto[state].items():
                f = fail[state]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[nxt] = goto[f].get(ch, 0) if state else 0
                if out[nxt] < 0:
                    out[nxt] = out[fail[nxt]]
                queue.append(nxt)
        self._goto, self._fail, self._depth, self._path, self._out = goto, fail, depth, path, out
        #: Characters that leave the root: text without them passes straight through.
        self._first = frozenset(goto[0])
        self._state = 0
        #: The stop string that matched, once one has.
        self.matched: str | None = None

    def _held(self) -> str:
        state = self._state
        return self.stops[self._path[state]][: self._depth[state]] if state else ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add text; returns ``(text_to_emit, matched)``. After a match, returns ``("", True)``."""
        if self.matched is not None:
            return "", True
        start = self._state
        if not start and self._first.isdisjoint(delta):
            return delta, False
        goto, fail, out = self._goto, self._fail, self._out
        state = start
        for end, ch in enumerate(delta, 1):
            while True:
                nxt = goto[state].get(ch)
                if nxt is not None:
                    state = nxt
                    break
                if not state:
                    break
                state = fail[state]
            hit = out[state]
            if hit >= 0:
                stop = self.stops[hit]
                self.matched = stop
                text = self._held() + delta[:end]
                self._state = 0
                return (text if self._include else text[: len(text) - len(stop)]), True
        held = self._held()
        self._state = state
        cut = len(delta) - self._depth[state]
        return (held + delta[:cut] if cut >= 0 else held[: len(held) + cut]), False

    def flush(self) -> str:
        """The held-back text, at the end of a stream that did not match."""
        text = self._held()
        self._state = 0
        return text
