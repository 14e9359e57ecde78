"""``tool_choice`` of a chat request: ``none``, ``auto``, ``required`` (with tools) or a
function among the tools (400 otherwise)."""

from __future__ import annotations

from collections.abc import Collection

from .errors import bad_request

__all__ = ["validate_tool_choice"]


def validate_tool_choice(choice: object, tool_names: Collection[str]) -> None:
    """``tool_choice``: none, auto, required (with tools) or a function among the tools, given
    by the names of their functions."""
    if choice is None or choice in ("none", "auto"):
        return
    if choice == "required":
        if not tool_names:
            raise bad_request("'tool_choice' 'required' needs 'tools'", param="tool_choice")
        return
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request(
                "'tool_choice' must name a function: "
                '{"type": "function", "function": {"name": ...}}',
                param="tool_choice", code="invalid_value",
            )
        if name not in tool_names:
            raise bad_request(
                f"'tool_choice' names the function {name!r}, which is not in 'tools'",
                param="tool_choice", code="invalid_value",
            )
        return
    raise bad_request(
        f"'tool_choice' must be 'none', 'auto', 'required' or a function, got {choice!r}",
        param="tool_choice",
        code="invalid_value",
    )
