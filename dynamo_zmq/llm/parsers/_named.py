"""``tool_choice`` naming a function: the (constrained) output is that function's arguments
object, streamed as the arguments of one call."""

from __future__ import annotations

from .._messages import ToolCallDelta
from ._tool_base import ToolParser, new_call_id

__all__ = ["NamedToolParser"]


class NamedToolParser(ToolParser):
    """All text is the arguments of one call of ``function``; the call's first delta (id and
    name) goes out with its first text."""

    name = "named"

    def __init__(self, function: str) -> None:
        super().__init__()
        self.function = function

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        if not delta:
            return "", []
        if self.calls:
            return "", [ToolCallDelta(0, arguments=delta)]
        self.calls = 1
        return "", [ToolCallDelta(0, id=new_call_id(self.id_seed), name=self.function),
                    ToolCallDelta(0, arguments=delta)]

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return "", []
