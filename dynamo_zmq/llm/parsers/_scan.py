"""Scanning helpers shared by the tool-call parsers: where a bracketed value ends, string-aware,
on text that may still be incomplete."""

from __future__ import annotations

__all__ = ["INCOMPLETE", "MISMATCH", "balanced_end", "skip"]

_CLOSE = {"{": "}", "[": "]", "(": ")"}
#: ``balanced_end`` results besides an index.
INCOMPLETE = -1
MISMATCH = -2


def balanced_end(text: str, start: int, quotes: str = '"') -> int:
    """The index just past the bracket closing ``text[start]`` (``{``, ``[`` or ``(``), skipping
    brackets inside strings (``quotes``, backslash escapes); ``INCOMPLETE`` when the text ends
    first, ``MISMATCH`` when a wrong closer comes first."""
    stack = [_CLOSE[text[start]]]
    quote = ""
    i = start + 1
    n = len(text)
    while i < n:
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in quotes:
            quote = c
        elif c in _CLOSE:
            stack.append(_CLOSE[c])
        elif c in ")]}":
            if c != stack.pop():
                return MISMATCH
            if not stack:
                return i + 1
        i += 1
    return INCOMPLETE


def skip(text: str, i: int, chars: str = " \t\r\n") -> int:
    """The first index at or after ``i`` whose character is not in ``chars``."""
    n = len(text)
    while i < n and text[i] in chars:
        i += 1
    return i
