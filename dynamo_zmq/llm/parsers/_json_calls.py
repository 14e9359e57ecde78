"""An incremental scanner for the JSON tool-call families: call objects
``{"name": ..., "arguments": {...}}`` one after another (separators, an optional closer),
read as the text grows, so a call's name is known as soon as its string is complete and its
arguments can stream as the model writes them.

Only structure is tracked (strings, escapes, nesting); the arguments object is the model's text
as written, never re-serialised, so its streamed pieces concatenate to exactly that text.
"""

from __future__ import annotations

import json
import re

from ._tool_base import Region

__all__ = ["JsonCalls"]

_WS = " \t\r\n"
_CLOSERS = {"{": "}", "[": "]"}
_STRING_BODY = re.compile(r'[^"\\]*')
_PRIMITIVE_END = _WS + ",}"

# object states
_KEY_OR_END, _KEY_START, _KEY, _COLON, _VALUE, _CONTAINER, _STRING, _PRIMITIVE, _AFTER = range(9)


class _Fail(Exception):
    """The text at this index breaks the call object's structure."""


class _Object:
    """One call object being scanned (``start`` is its ``{``)."""

    __slots__ = ("args", "args_kind", "args_start", "esc", "in_str", "key", "key_start",
                 "name", "stack", "state", "val_start")

    def __init__(self) -> None:
        self.state = _KEY_OR_END
        self.key: str | None = None
        self.key_start = 0
        self.val_start = 0
        self.stack: list[str] = []
        self.in_str = False
        self.esc = False
        self.name: str | None = None
        self.args_start = -1  # where the arguments value starts (-1: not seen)
        self.args_kind = ""  # its first character
        self.args: str | None = None  # the arguments, once their value is complete

    def so_far(self, text: str, pos: int) -> str:
        """The arguments known to be final text up to ``pos``: an object's text as written so
        far; other values only once complete; none yet: ``""``."""
        if self.args is not None:
            return self.args
        if self.args_kind == "{":
            return text[self.args_start : pos]
        return ""

    def whole(self) -> str:
        """The arguments of the complete object (``{}`` when it has none)."""
        return "{}" if self.args is None else self.args


class JsonCalls:
    """The call objects of one region, scanned incrementally: ``scan`` is called with the
    region's text so far (it only grows) and resumes where it stopped.

    Args:
        start: where the first object (or separators before it) may start.
        keys: the arguments' key names, any one of them.
        seps: separator characters allowed between objects (besides whitespace).
        close: the region's closing string ("": the region ends at the first character that is
            no separator and starts no object).
        single: at most one object (then only whitespace and ``close``).
    """

    def __init__(self, start: int, keys: tuple[str, ...], seps: str, close: str,
                 single: bool = False) -> None:
        self.pos = start
        self.keys = keys
        self.skip = _WS + seps
        self.close = close
        self.single = single
        self.calls: list[tuple[str, str]] = []
        self.call_end = 0
        self.obj: _Object | None = None

    def scan(self, text: str, final: bool) -> Region:
        """The calls in ``text`` so far (see ``Region``); the call whose name is known but whose
        object is still open is ``Region.partial``."""
        n = len(text)
        while True:
            obj = self.obj
            if obj is not None:
                try:
                    end = self._object(obj, text)
                except _Fail as fail:
                    return self._failed(obj, text, fail.args[0])
                if end < 0:  # the text ended inside the object
                    if obj.name is None:
                        return Region(self.calls, "fail" if final else "more", n, self.call_end)
                    if final:  # cut short after its name went out: the call stays as it is
                        self.calls.append((obj.name, obj.so_far(text, n)))
                        return Region(self.calls, "done", n, n)
                    return Region(self.calls, "more", 0, self.call_end,
                                  (obj.name, obj.so_far(text, n)))
                if obj.name is None:  # a complete object, but no call
                    return Region(self.calls, "fail", end, self.call_end)
                self.calls.append((obj.name, obj.whole()))
                self.obj, self.call_end, self.pos = None, end, end
            i = self.pos = _skip(text, self.pos, self.skip)
            if i >= n:
                return Region(self.calls, "done" if final else "more", n, self.call_end)
            close = self.close
            if close and text.startswith(close, i):
                return Region(self.calls, "done", i + len(close), self.call_end)
            if close and close.startswith(text[i:]) and not final:
                return Region(self.calls, "more", 0, self.call_end)
            if text[i] == "{" and not (self.single and self.calls):
                self.obj, self.pos = _Object(), i + 1
                continue
            if close and not (self.single and self.calls):
                return Region(self.calls, "fail", i + 1, self.call_end)
            return Region(self.calls, "done", self.call_end, self.call_end)

    def _failed(self, obj: _Object, text: str, at: int) -> Region:
        if obj.name is None:
            return Region(self.calls, "fail", at + 1, self.call_end)
        # after its name went out the call stands, with the arguments as far as they went;
        # the text from the fault on is text again
        self.calls.append((obj.name, obj.so_far(text, at)))
        self.obj = None
        return Region(self.calls, "fail", at + 1, at)

    def _object(self, obj: _Object, text: str) -> int:
        """Scan ``obj`` from ``self.pos``: the index past its ``}``, or -1 at the text's end."""
        i = self.pos
        n = len(text)
        while i < n:
            c = text[i]
            state = obj.state
            if state == _STRING or state == _KEY or (state == _CONTAINER and obj.in_str):
                if obj.esc:
                    obj.esc = False
                    i += 1
                    continue
                i = _STRING_BODY.match(text, i).end()  # type: ignore[union-attr]
                if i >= n:
                    break
                if text[i] == "\\":
                    obj.esc = True
                    i += 1
                    continue
                i += 1  # the closing quote
                if state == _KEY:
                    obj.key = str(_decode(text[obj.key_start : i], i))
                    obj.state = _COLON
                elif state == _STRING:
                    self._value(obj, text, i)
                else:
                    obj.in_str = False
                continue
            if state == _CONTAINER:
                if c == '"':
                    obj.in_str = True
                elif c in _CLOSERS:
                    obj.stack.append(_CLOSERS[c])
                elif c in "]}":
                    if c != obj.stack.pop():
                        raise _Fail(i)
                    if not obj.stack:
                        self._value(obj, text, i + 1)
                i += 1
                continue
            if state == _PRIMITIVE:
                if c in _PRIMITIVE_END:
                    self._value(obj, text, i)
                else:
                    i += 1
                continue
            if c in _WS:
                i += 1
                continue
            if state == _KEY_OR_END or state == _KEY_START:
                if c == '"':
                    obj.state, obj.key_start = _KEY, i
                elif c == "}" and state == _KEY_OR_END:
                    self.pos = i + 1
                    return i + 1
                else:
                    raise _Fail(i)
            elif state == _COLON:
                if c != ":":
                    raise _Fail(i)
                obj.state = _VALUE
            elif state == _VALUE:
                obj.val_start = i
                if obj.key in self.keys and obj.args_start < 0:
                    obj.args_start, obj.args_kind = i, c
                if c in _CLOSERS:
                    obj.state, obj.stack = _CONTAINER, [_CLOSERS[c]]
                elif c == '"':
                    obj.state = _STRING
                elif c in ",}]:":
                    raise _Fail(i)
                else:
                    obj.state = _PRIMITIVE
                    continue  # the primitive's first character is read in its state
            else:  # _AFTER
                if c == ",":
                    obj.state = _KEY_START
                elif c == "}":
                    self.pos = i + 1
                    return i + 1
                else:
                    raise _Fail(i)
            i += 1
        self.pos = i
        return -1

    def _value(self, obj: _Object, text: str, end: int) -> None:
        """A value ended just before ``end``: a call's name or arguments, or any other value."""
        raw = text[obj.val_start : end]
        if obj.state == _PRIMITIVE:
            _decode(raw, obj.val_start)
        if obj.key == "name" and obj.name is None:
            name = _decode(raw, obj.val_start) if raw.startswith('"') else None
            if not isinstance(name, str) or not name:
                raise _Fail(obj.val_start)
            obj.name = name
        elif obj.args_start == obj.val_start:
            obj.args = str(_decode(raw, end)) if obj.args_kind == '"' else raw
        obj.state = _AFTER


def _decode(raw: str, at: int) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        raise _Fail(at) from None


def _skip(text: str, i: int, chars: str) -> int:
    n = len(text)
    while i < n and text[i] in chars:
        i += 1
    return i
