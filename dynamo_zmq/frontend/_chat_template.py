"""Chat templates as Hugging Face ``transformers`` renders them: the environment and the inputs.

Templates compile in a sandboxed jinja2 environment (``template_environment``) with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, ``{% generation %}``
blocks, ``raise_exception``, ``strftime_now`` and transformers' ``tojson`` filter. They render
messages and tools as plain dicts (``message_dict``, ``function_dict``), tool-call arguments
parsed into mappings as vLLM passes them; ``continue_final`` cuts a rendering after the final
message's content. The ``Preprocessor`` (``preprocess.py``) owns which template and variables.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import bad_request
from .protocol import ChatMessage, FunctionDefinition

__all__ = [
    "RESERVED",
    "continue_final",
    "function_dict",
    "message_dict",
    "template_environment",
]

#: Template variables that request ``chat_template_kwargs`` may not override.
RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant masks): the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter: no HTML escaping, json.dumps options exposed.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def template_environment() -> ImmutableSandboxedEnvironment:
    """The jinja2 environment chat templates are compiled in (as transformers builds it)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def message_dict(message: ChatMessage, image: str = "", parts: bool = False) -> dict[str, Any]:
    """One chat message as templates read it: text content, tool calls with mapping arguments.

    Content parts become one text, joined by newlines, each image part ``image``; or, with
    ``parts`` and an image among them, the list of ``{"type": "text", "text": ...}`` and
    ``{"type": "image"}`` parts that Hugging Face's vision templates take.
    """
    content = message.content
    text: str | list[dict[str, str]]
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif parts and any(part.type == "image_url" for part in content):
        text = [{"type": "image"} if part.type == "image_url"
                else {"type": "text", "text": part.text or ""} for part in content]
    else:
        text = "\n".join(image if part.type == "image_url" else part.text or ""
                         for part in content)
    out: dict[str, Any] = {"role": message.role, "content": text}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls is not None:
        calls = []
        for call in message.tool_calls:
            arguments: Any = call.function.arguments
            if isinstance(arguments, str):
                try:  # templates expect a mapping, as vLLM passes it
                    parsed = json.loads(arguments)
                except ValueError:
                    parsed = None
                if isinstance(parsed, dict):
                    arguments = parsed
            item: dict[str, Any] = {
                "type": call.type,
                "function": {"name": call.function.name, "arguments": arguments},
            }
            if call.id is not None:
                item["id"] = call.id
            calls.append(item)
        out["tool_calls"] = calls
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.reasoning_content is not None:
        out["reasoning_content"] = message.reasoning_content
    return out


def function_dict(function: FunctionDefinition) -> dict[str, Any]:
    """One tool's function as templates read it: only the fields the request set."""
    out: dict[str, Any] = {"name": function.name}
    if function.description is not None:
        out["description"] = function.description
    if function.parameters is not None:
        out["parameters"] = function.parameters
    if function.strict is not None:
        out["strict"] = function.strict
    return out


def continue_final(text: str, final: str) -> str:
    """Cut the rendering right after the final message's content (transformers' rule)."""
    final = final.strip()
    if not final:
        return text
    at = text.rfind(final)
    if at < 0:
        raise bad_request(
            "'continue_final_message' needs the final message's content in the rendered prompt",
            param="continue_final_message",
        )
    return text[: at + len(final)]
