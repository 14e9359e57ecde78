"""The tool-call families: Hermes/Qwen ``<tool_call>`` JSON, Llama 3 JSON, Mistral
``[TOOL_CALLS]`` and pythonic ``[f(a=1), g()]``, and the JSON a ``tool_choice`` of
``required`` constrains the output to."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from ._scan import INCOMPLETE, MISMATCH, balanced_end, call_of, skip
from ._tool_base import Region, ToolParser

__all__ = [
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "PythonicToolParser",
    "RequiredToolParser",
]

_NAME_ARGS = ("arguments", "parameters")


class HermesToolParser(ToolParser):
    """Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number
    per message, text between them is content."""

    name = "hermes"
    markers = ("<tool_call>",)
    _close = "</tool_call>"

    def parse_region(self, text: str, final: bool) -> Region:
        end = text.find(self._close)
        if end < 0:
            if final and (call := call_of(text.strip(), _NAME_ARGS)) is not None:
                return Region([call], "done", len(text), len(text))  # no closing tag at EOS
            return Region([], "more")
        stop = end + len(self._close)
        call = call_of(text[:end].strip(), _NAME_ARGS)
        if call is None:
            return Region([], "fail", stop, 0)
        return Region([call], "done", stop, stop)


def _objects(
    text: str, i: int, seps: str, close: str, keys: tuple[str, ...], final: bool
) -> Region:
    """JSON call objects from ``i`` on, separated by ``seps`` (and whitespace), up to ``close``
    (or, with ``close`` empty, the first other character; ``final``: the end of the text)."""
    calls: list[tuple[str, str]] = []
    call_end = 0
    n = len(text)
    while True:
        i = skip(text, i, " \t\r\n" + seps)
        if i >= n:
            return Region(calls, "done" if final else "more", n, call_end)
        c = text[i]
        if close and c == close:
            return Region(calls, "done", i + 1, call_end)
        if c != "{":
            if close:
                return Region(calls, "fail", i + 1, call_end)
            return Region(calls, "done", call_end, call_end)
        end = balanced_end(text, i)
        if end == INCOMPLETE:
            return Region(calls, "more", 0, call_end)
        if end == MISMATCH or (call := call_of(text[i:end], keys)) is None:
            return Region(calls, "fail", max(end, i + 1), call_end)
        calls.append(call)
        i = call_end = end


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON tool calls: ``{"name": ..., "parameters": {...}}`` starting the output or
    after ``<|python_tag|>``, several separated by ``;``."""

    name = "llama3_json"
    markers = ("<|python_tag|>",)
    openers = "{"

    def parse_region(self, text: str, final: bool) -> Region:
        i = skip(text, 0)
        if i < len(text) and text[i] != "{":
            return Region([], "fail", i + 1, 0)
        return _objects(text, i, ";", "", _NAME_ARGS[::-1], final)


class MistralToolParser(ToolParser):
    """Mistral: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` (or one
    object)."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)

    def parse_region(self, text: str, final: bool) -> Region:
        i = skip(text, 0)
        if i >= len(text):
            return Region([], "more")
        if text[i] == "[":
            return _objects(text, i + 1, ",", "]", _NAME_ARGS, final)
        if text[i] == "{":
            return _objects(text, i, "", "", _NAME_ARGS, final)
        return Region([], "fail", i + 1, 0)


class RequiredToolParser(ToolParser):
    """``tool_choice: required``: the output is the JSON array the frontend's schema asks for,
    ``[{"name": ..., "parameters": {...}}, ...]``."""

    name = "required"
    openers = "["

    def parse_region(self, text: str, final: bool) -> Region:
        return _objects(text, 1, ",", "]", _NAME_ARGS[::-1], final)


_IDENT = re.compile(r"[A-Za-z_][\w.]*")


def _python_call(source: str) -> tuple[str, str] | None:
    try:
        node = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = ast.unparse(node.func)
    if not isinstance(node.func, ast.Name | ast.Attribute) or not _IDENT.fullmatch(name):
        return None
    args: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:
            return None
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
    try:
        return name, json.dumps(args, ensure_ascii=False)
    except (TypeError, ValueError):  # sets, bytes, complex numbers: no JSON for them
        return None


class PythonicToolParser(ToolParser):
    """Pythonic (Llama 3.2/4 style): the output starts with ``[f(a=1, b="x"), g()]``; each call
    is read with ``ast`` (keyword arguments, literal values)."""

    name = "pythonic"
    openers = "["

    def parse_region(self, text: str, final: bool) -> Region:
        calls: list[tuple[str, str]] = []
        call_end = 0
        i = 1
        n = len(text)
        while True:
            i = skip(text, i, " \t\r\n,")
            if i >= n:
                return Region(calls, "done" if final else "more", n, call_end)
            if text[i] == "]":
                return Region(calls, "done", i + 1, call_end)
            match = _IDENT.match(text, i)
            if match is None:
                return Region(calls, "fail", i + 1, call_end)
            j = skip(text, match.end())
            if j >= n:
                return Region(calls, "more", 0, call_end)
            if text[j] != "(":
                return Region(calls, "fail", j + 1, call_end)
            end = balanced_end(text, j, "'\"")
            if end == INCOMPLETE:
                return Region(calls, "more", 0, call_end)
            if end == MISMATCH or (call := _python_call(text[i:end])) is None:
                return Region(calls, "fail", max(end, j + 1), call_end)
            calls.append(call)
            i = call_end = end
