"""The streaming machinery every tool-call parser shares.

Text goes through two states. In *text*, content streams out, holding back only what may still
start a tool-call region: a partial start marker, trailing whitespace (dropped when a region
follows), and, at the very start of the output, an opener the family may begin with (Llama's
``{``, pythonic ``[``). In a *region* (after its marker) text is buffered and handed, whole so
far, to the family's ``parse_region``, which reports the calls in it and whether the region
goes on, ended, or is not a tool call after all. A family either reports a call once its markup
is complete (pythonic), or, as the JSON families do, also the call still being written once its
name is known (``Region.partial``): its first delta goes out then, and its arguments stream as
they grow. Markup that turns out invalid, or is still open at the end, before a call's name went
out comes back as content; a call whose name went out stands. Every decision depends only on
the text, never on how it was split into deltas, so a stream gives the same calls and content
as the whole text.
"""

from __future__ import annotations

import hashlib
import uuid
from typing import ClassVar, NamedTuple

from .._messages import ToolCallDelta

__all__ = ["Region", "ToolParser", "new_call_id"]

_WS = " \t\r\n"


def new_call_id(seed: str = "", index: int = 0) -> str:
    """A tool call's id, as OpenAI's look (``call_`` and 24 hex digits): derived from ``seed``
    (the request's id) and the call's index when a seed is given, so a migrated request's new
    worker names a call as the lost one did; random otherwise."""
    if not seed:
        return f"call_{uuid.uuid4().hex[:24]}"
    return f"call_{hashlib.sha256(f'{seed}/{index}'.encode()).hexdigest()[:24]}"


class Region(NamedTuple):
    """What ``parse_region`` found in a region's text so far."""

    #: Every finished call in the region, in order: ``(name, arguments)`` (complete and valid,
    #: or one that went out by its name and ended early: its arguments as far as they went).
    calls: list[tuple[str, str]]
    #: ``more`` (wait for text), ``done`` (the region ended at ``end``) or ``fail`` (the text
    #: after the last call, up to ``end``, is no tool call: it is content).
    status: str
    #: Where the region (``done``) or its invalid part (``fail``) ends; text after it is text.
    end: int = 0
    #: Where the last valid call ends (``fail``: content starts there).
    call_end: int = 0
    #: ``more``: the call after ``calls`` whose name is known, with its arguments so far (a
    #: prefix of its arguments once complete).
    partial: tuple[str, str] | None = None


class ToolParser:
    """A tool-call parser for one request: ``feed`` text deltas, then ``finish`` once; each
    returns ``(content, tool call deltas)``. Families set ``markers`` and/or ``openers`` and
    implement ``parse_region``."""

    #: The registry name (``--tool-call-parser NAME``).
    name: ClassVar[str] = ""
    #: Strings that open a region anywhere in the text (not part of the region's text).
    markers: ClassVar[tuple[str, ...]] = ()
    #: Characters that open a region when they begin the output (part of its text).
    openers: ClassVar[str] = ""

    def __init__(self) -> None:
        self._buf = ""
        self._fresh = True  # nothing emitted yet: an opener may still begin a region
        self._marker: str | None = None  # the open region's marker ("" for an opener)
        self._emitted = 0  # calls of the open region already emitted
        self._open_call = -1  # index of the call whose first delta went out, still growing
        self._sent = 0  # how much of that call's arguments went out
        self._hold = max((len(m) for m in self.markers), default=1) - 1
        #: Tool calls emitted so far.
        self.calls = 0
        #: What call ids derive from (``new_call_id``); "": random ids.
        self.id_seed = ""

    def parse_region(self, text: str, final: bool) -> Region:
        """The calls in a region's ``text`` (everything after its marker, so far)."""
        raise NotImplementedError

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        """Add text; returns the content and tool-call deltas that are certain now."""
        self._buf += delta
        return self._run(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """Flush at the end of the output: open markup comes back as content."""
        content, calls = self._run(final=True)
        if not self.calls:
            content += self._buf  # held whitespace is content when no call was made
        self._buf = ""
        return content, calls

    def _run(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        out: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            if self._marker is None:
                if not self._text(out, final):
                    break
            elif not self._region(out, deltas, final):
                break
        return "".join(out), deltas

    def _text(self, out: list[str], final: bool) -> bool:
        """Text state; True when a region opened (keep going)."""
        buf = self._buf
        if self._fresh and self.openers:
            start = len(buf) - len(buf.lstrip(_WS))
            if start == len(buf):
                return False  # only whitespace so far
            if buf[start] in self.openers:
                self._open(buf[:start], buf[start:])
                return True
        at, marker = -1, ""
        for m in self.markers:
            i = buf.find(m)
            if i >= 0 and (at < 0 or i < at):
                at, marker = i, m
        if at >= 0:
            before = buf[:at]
            kept = before.rstrip(_WS)  # whitespace before a call is dropped, unless it fails
            self._emit(out, kept)
            self._open(before[len(kept) :] + marker, buf[at + len(marker) :])
            return True
        keep = 0 if final else self._partial(buf)
        body = buf[: len(buf) - keep]
        stripped = body.rstrip(_WS)
        if final and not self.calls:
            stripped = body
        self._emit(out, stripped)
        self._buf = buf[len(stripped) :]
        return False

    def _partial(self, buf: str) -> int:
        for k in range(min(len(buf), self._hold), 0, -1):
            tail = buf[-k:]
            if any(m.startswith(tail) for m in self.markers):
                return k
        return 0

    def _emit(self, out: list[str], text: str) -> None:
        if text:
            out.append(text)
            if text.strip(_WS):
                self._fresh = False

    def _open(self, marker: str, rest: str) -> None:
        self._marker, self._buf, self._emitted, self._fresh = marker, rest, 0, False
        self.open_region()

    def open_region(self) -> None:
        """A region opens: families that scan incrementally start afresh."""

    def _send(self, deltas: list[ToolCallDelta], name: str, args: str, done: bool) -> None:
        """A call's deltas: its first (id, name) unless it went out already, then whatever of
        its ``args`` has not."""
        index = self._open_call
        if index < 0:
            index = self.calls
            self.calls += 1
            deltas.append(ToolCallDelta(index, id=new_call_id(self.id_seed, index), name=name))
            self._sent = 0
        if len(args) > self._sent:
            deltas.append(ToolCallDelta(index, arguments=args[self._sent :]))
            self._sent = len(args)
        self._open_call = -1 if done else index

    def _region(self, out: list[str], deltas: list[ToolCallDelta], final: bool) -> bool:
        """Region state; True when the region closed (keep going in text)."""
        region = self.parse_region(self._buf, final)
        status = region.status
        if status == "more" and final:
            region = Region(region.calls, "fail", len(self._buf), region.call_end)
            status = "fail"
        for name, args in region.calls[self._emitted :]:
            self._send(deltas, name, args, True)
        self._emitted = len(region.calls)
        if region.partial is not None:
            self._send(deltas, *region.partial, False)
        if status == "more":
            return False
        if status == "done" and not region.calls:
            status = "fail"  # an empty region is no tool call
            region = Region([], "fail", region.end, 0)
        if status == "fail":
            lead = "" if region.calls else (self._marker or "")
            text = lead + self._buf[region.call_end : region.end]
            if text:
                out.append(text)
                self._fresh = False
        self._buf = self._buf[region.end :]
        self._marker = None
        return True
