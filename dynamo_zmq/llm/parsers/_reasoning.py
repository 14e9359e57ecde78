"""Reasoning parsers: ``<think>...</think>`` reasoning moved out of the content.

``deepseek_r1``: the output starts inside the reasoning (the template may have opened it, so an
opening ``<think>`` is optional) and ``</think>`` ends it; without one, all is reasoning.
``qwen3``: reasoning only when the output starts with ``<think>`` (after whitespace); text
after ``</think>``, or all of it otherwise, is content. Like the tool-call parsers, only text
that may still be a tag is held back, and any split of the text gives the same result.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = ["DeepSeekR1ReasoningParser", "Qwen3ReasoningParser", "ReasoningParser"]

_OPEN, _CLOSE = "<think>", "</think>"
_WS = " \t\r\n"


class ReasoningParser:
    """Per request: ``feed`` text deltas, then ``finish`` once; each returns
    ``(reasoning, content)``."""

    #: The registry name (``--reasoning-parser NAME``).
    name: ClassVar[str] = ""
    #: Whether text before any tag is reasoning.
    starts_in_reasoning: ClassVar[bool] = False

    def __init__(self) -> None:
        self._buf = ""
        self._state = "start"  # start -> think -> content (or start -> content)

    def feed(self, delta: str) -> tuple[str, str]:
        """Add text; returns the reasoning and content that are certain now."""
        self._buf += delta
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        """Flush what is held back at the end of the output."""
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        if self._state == "start":
            head = self._buf.lstrip(_WS)
            if head.startswith(_OPEN):
                self._buf, self._state = head[len(_OPEN) :], "think"
            elif _OPEN.startswith(head) and not final:
                return "", ""  # may still open with <think>
            else:
                self._state = "think" if self.starts_in_reasoning else "content"
        if self._state == "think":
            buf = self._buf
            at = buf.find(_CLOSE)
            if at >= 0:
                reasoning, self._buf, self._state = buf[:at], buf[at + len(_CLOSE) :], "content"
            else:
                keep = 0 if final else _partial(buf)
                reasoning, self._buf = buf[: len(buf) - keep], buf[len(buf) - keep :]
                return reasoning, ""
        content, self._buf = self._buf, ""
        return reasoning, content


def _partial(buf: str) -> int:
    for k in range(min(len(buf), len(_CLOSE) - 1), 0, -1):
        if _CLOSE.startswith(buf[-k:]):
            return k
    return 0


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: reasoning until ``</think>`` (an opening ``<think>`` is optional)."""

    name = "deepseek_r1"
    starts_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: reasoning between a leading ``<think>`` and ``</think>``."""

    name = "qwen3"
