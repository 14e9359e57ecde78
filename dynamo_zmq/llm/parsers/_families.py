"""The tool-call families: Hermes/Qwen ``<tool_call>`` JSON, Llama 3 JSON, Mistral
``[TOOL_CALLS]`` and pythonic ``[f(a=1), g()]``, and the JSON a ``tool_choice`` of
``required`` constrains the output to."""

from __future__ import annotations

import ast
import json
import re
from typing import Any, ClassVar

from ._json_calls import JsonCalls
from ._scan import INCOMPLETE, MISMATCH, balanced_end, skip
from ._tool_base import Region, ToolParser

__all__ = [
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "PythonicToolParser",
    "RequiredToolParser",
]

_NAME_ARGS = ("arguments", "parameters")


class _JsonToolParser(ToolParser):
    """A family whose calls are JSON objects: scanned incrementally (``JsonCalls``), so a
    call's first delta goes out once its name is known and its arguments stream as written."""

    #: The arguments' key names.
    keys: ClassVar[tuple[str, ...]] = _NAME_ARGS

    def __init__(self) -> None:
        super().__init__()
        self._json: JsonCalls | None = None

    def open_region(self) -> None:
        self._json = None

    def parse_region(self, text: str, final: bool) -> Region:
        if self._json is None:
            i = skip(text, 0)
            if i >= len(text):
                return Region([], "fail" if final else "more", len(text))
            json_calls = self.start(text, i)
            if json_calls is None:
                return Region([], "fail", i + 1, 0)
            self._json = json_calls
        return self._json.scan(text, final)

    def start(self, text: str, i: int) -> JsonCalls | None:
        """The scanner for a region whose first non-blank character is ``text[i]``; None when
        it is no tool call."""
        raise NotImplementedError


class HermesToolParser(_JsonToolParser):
    """Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number
    per message, text between them is content (at the end of the output, the closing tag may
    be missing)."""

    name = "hermes"
    markers = ("<tool_call>",)

    def start(self, text: str, i: int) -> JsonCalls | None:
        if text[i] != "{":
            return None
        return JsonCalls(i, self.keys, "", "</tool_call>", single=True)


class Llama3JsonToolParser(_JsonToolParser):
    """Llama 3.x JSON tool calls: ``{"name": ..., "parameters": {...}}`` starting the output or
    after ``<|python_tag|>``, several separated by ``;``."""

    name = "llama3_json"
    markers = ("<|python_tag|>",)
    openers = "{"
    keys = _NAME_ARGS[::-1]

    def start(self, text: str, i: int) -> JsonCalls | None:
        return JsonCalls(i, self.keys, ";", "") if text[i] == "{" else None


class MistralToolParser(_JsonToolParser):
    """Mistral: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` (or one
    object)."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)

    def start(self, text: str, i: int) -> JsonCalls | None:
        if text[i] == "[":
            return JsonCalls(i + 1, self.keys, ",", "]")
        if text[i] == "{":
            return JsonCalls(i, self.keys, "", "")
        return None


class RequiredToolParser(_JsonToolParser):
    """``tool_choice: required``: the output is the JSON array the frontend's schema asks for,
    ``[{"name": ..., "parameters": {...}}, ...]``."""

    name = "required"
    openers = "["
    keys = _NAME_ARGS[::-1]

    def start(self, text: str, i: int) -> JsonCalls | None:
        return JsonCalls(i + 1, self.keys, ",", "]")


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
