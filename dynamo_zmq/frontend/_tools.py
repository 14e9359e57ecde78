"""What a chat request's tools and the model's parsers ask of the worker: ``ToolOptions`` (tool
calls parsed for ``auto``, only the first of them with ``parallel_tool_calls: false``;
``required`` and a named function enforced with structured outputs, as vLLM's server does), and
reasoning parsing."""

from __future__ import annotations

from typing import Any

from ..llm import Capability, GuidedDecoding, PreprocessedRequest, ToolOptions
from .errors import bad_request
from .models import ModelEntry
from .protocol import ChatCompletionRequest, Tool

__all__ = ["apply_tools", "required_schema"]

_ANY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or _ANY_OBJECT


def required_schema(tools: list[Tool], parallel: bool = True) -> dict[str, Any]:
    """The JSON schema of ``tool_choice: required``: an array of at least one
    ``{"name": <a tool's name>, "parameters": <that tool's parameters>}`` (exactly one when
    ``parallel`` is false: ``parallel_tool_calls: false``)."""
    limit: dict[str, Any] = {} if parallel else {"maxItems": 1}
    return {
        "type": "array",
        "minItems": 1,
        **limit,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": [t.function.name]},
                        "parameters": _parameters(t),
                    },
                    "required": ["name", "parameters"],
                }
                for t in tools
            ],
        },
    }


def apply_tools(req: ChatCompletionRequest, entry: ModelEntry, pre: PreprocessedRequest) -> None:
    """Set ``pre.tools``, ``pre.guided`` (``required`` / a named function) and
    ``pre.reasoning`` for a parsed chat request.

    Raises:
        HttpError: 400 when ``required`` or a named function needs structured outputs the
            serving engine lacks, or the request also constrains its output otherwise.
    """
    pre.reasoning = entry.reasoning_parser is not None
    choice = req.tool_choice
    if not req.tools or choice == "none":
        return
    if choice is None or choice == "auto":
        pre.tools = ToolOptions("auto", parallel=req.parallel_tool_calls is not False)
        if entry.tool_call_parser == "mistral":
            # [TOOL_CALLS] is a control token in Mistral's tokenizers: keep it in the text
            # for the parser (as vLLM's Mistral parser does)
            pre.output.skip_special_tokens = False
        return
    entry.require(Capability.STRUCTURED_OUTPUTS, "tool_choice")
    if pre.guided is not None:
        raise bad_request(
            "'tool_choice' 'required' or a named function cannot be combined with another "
            "output constraint", param="tool_choice",
        )
    if choice == "required":
        pre.tools = ToolOptions("required")
        pre.guided = GuidedDecoding(
            json_schema=required_schema(req.tools, req.parallel_tool_calls is not False)
        )
        return
    assert isinstance(choice, dict)  # protocol.py checked it names one of the tools
    name = choice["function"]["name"]
    tool = next(t for t in req.tools if t.function.name == name)
    pre.tools = ToolOptions("function", name)
    pre.guided = GuidedDecoding(json_schema=_parameters(tool))
