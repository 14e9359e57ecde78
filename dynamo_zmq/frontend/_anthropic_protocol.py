"""Anthropic Messages API request bodies, checked and translated into the internal chat request.

``parse_messages`` / ``parse_count_tokens`` decode ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` bodies, check what Anthropic's API checks (``max_tokens``
required, ``temperature`` in [0, 1], roles ``user`` / ``assistant``, ``thinking`` budgets), and
``to_chat`` turns one into the ``ChatCompletionRequest`` the chat route would have got, so the
same chat template, tokenizer, sampling, stop and tool machinery serve it:

* ``system`` (a string or text blocks) becomes a leading system message;
* text blocks stay text parts; an assistant's ``tool_use`` blocks become its ``tool_calls``
  and its ``thinking`` blocks its ``reasoning_content`` (``redacted_thinking`` is opaque: left
  out); a user's ``tool_result`` blocks become ``tool`` messages (before the user's text);
* ``tools`` (``input_schema``) become function tools; ``tool_choice`` ``auto`` / ``any`` /
  ``tool`` / ``none`` become ``auto`` / ``required`` / a named function / ``none``, and
  ``disable_parallel_tool_use`` ``parallel_tool_calls: false``;
* ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``max_tokens`` as they are.

What the frontend cannot serve is refused with a 400 naming it (images, documents, server
tools, MCP servers, containers), never ignored.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ._api_params import messages_names
from .errors import HttpError, bad_request, unsupported
from .protocol import ChatCompletionRequest, _decode, parse_chat

__all__ = [
    "CountTokensRequest",
    "MessagesRequest",
    "parse_count_tokens",
    "parse_messages",
    "to_chat",
]

#: Anthropic's smallest thinking budget.
MIN_THINKING_BUDGET = 1024


class Block(msgspec.Struct, kw_only=True):
    """One content block of any type (the fields each type uses; checked by ``_blocks``)."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: Any = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None
    source: Any = None
    cache_control: Any = None
    citations: Any = None


class MessageParam(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[Block]


class ToolParam(msgspec.Struct, kw_only=True):
    name: str
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None
    cache_control: Any = None


class ToolChoice(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(msgspec.Struct, kw_only=True):
    type: str
    budget_tokens: int | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/messages/count_tokens``: what shapes the prompt."""

    model: str
    messages: list[MessageParam]
    system: str | list[Block] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    mcp_servers: Any = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    """``POST /v1/messages``."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    container: Any = None
    context_management: Any = None


_messages_decoder = msgspec.json.Decoder(MessagesRequest)
_count_decoder = msgspec.json.Decoder(CountTokensRequest)


def _text_of(blocks: str | list[Block] | None, where: str) -> str | list[dict[str, str]]:
    """A string, or text blocks as chat text parts (any other block refused)."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    parts = []
    for j, block in enumerate(blocks):
        if block.type != "text":
            raise unsupported(f"{where}[{j}]", f"block type {block.type!r} (only 'text')")
        if block.text is None:
            raise bad_request(f"'{where}[{j}]' of type 'text' needs a 'text' string")
        parts.append({"type": "text", "text": block.text})
    return parts


def _tool_result(block: Block, where: str) -> dict[str, Any]:
    if not block.tool_use_id:
        raise bad_request(f"'{where}' of type 'tool_result' needs a 'tool_use_id'")
    content = block.content
    if content is not None and not isinstance(content, str):
        try:
            content = msgspec.convert(content, list[Block])
        except msgspec.ValidationError as exc:
            raise bad_request(f"'{where}.content': {exc}") from None
    return {"role": "tool", "tool_call_id": block.tool_use_id,
            "content": _text_of(content, f"{where}.content")}


def _tool_call(block: Block, where: str) -> dict[str, Any]:
    if not block.id or not block.name or not isinstance(block.input, dict):
        raise bad_request(f"'{where}' of type 'tool_use' needs an 'id', a 'name' and an "
                          "'input' object")
    return {"id": block.id, "type": "function",
            "function": {"name": block.name, "arguments": block.input}}


def _image(block: Block, where: str) -> dict[str, Any]:
    """An ``image`` block as chat's ``image_url`` part (a base64 source as a data URL)."""
    source = block.source if isinstance(block.source, dict) else {}
    kind, data, media_type = source.get("type"), source.get("data"), source.get("media_type")
    if kind == "base64" and isinstance(data, str) and isinstance(media_type, str):
        return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}
    if kind == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise bad_request(f"'{where}.source' must be a 'base64' source with 'media_type' and "
                      "'data', or a 'url' source with 'url'")


def _message(i: int, message: MessageParam) -> list[dict[str, Any]]:
    """The chat messages of one Anthropic message (a user's tool results first)."""
    role = message.role
    if role not in ("user", "assistant"):
        raise bad_request(f"'messages[{i}].role' must be 'user' or 'assistant', got {role!r} "
                          "(a system prompt goes in the top-level 'system')")
    if isinstance(message.content, str):
        return [{"role": role, "content": message.content}]
    out: list[dict[str, Any]] = []
    texts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    thoughts: list[str] = []
    for j, block in enumerate(message.content):
        where, kind = f"messages[{i}].content[{j}]", block.type
        if kind == "text":
            if block.text is None:
                raise bad_request(f"'{where}' of type 'text' needs a 'text' string")
            texts.append({"type": "text", "text": block.text})
        elif kind == "image" and role == "user":
            texts.append(_image(block, where))
        elif kind == "tool_result" and role == "user":
            out.append(_tool_result(block, where))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_call(block, where))
        elif kind == "thinking" and role == "assistant":
            thoughts.append(block.thinking or "")
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # encrypted by Anthropic: nothing a local model can read
        else:
            raise unsupported(where, f"block type {kind!r} in a {role} message")
    if role == "assistant":
        chat: dict[str, Any] = {"role": role, "content": texts or None}
        if calls:
            chat["tool_calls"] = calls
        if thoughts:
            chat["reasoning_content"] = "".join(thoughts)
        return [chat]
    if texts or not out:
        out.append({"role": role, "content": texts})
    return out


def _tool_choice(req: CountTokensRequest, chat: dict[str, Any]) -> None:
    choice = req.tool_choice
    if choice is None:
        return
    kinds = {"auto": "auto", "any": "required", "none": "none"}
    if choice.type == "tool":
        if not choice.name:
            raise bad_request("'tool_choice' of type 'tool' needs a 'name'")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice.type in kinds:
        chat["tool_choice"] = kinds[choice.type]
    else:
        raise bad_request(f"'tool_choice.type' must be 'auto', 'any', 'tool' or 'none', "
                          f"got {choice.type!r}")
    if choice.disable_parallel_tool_use:
        chat["parallel_tool_calls"] = False


def _tools(req: CountTokensRequest) -> list[dict[str, Any]] | None:
    if not req.tools:
        return None
    tools = []
    for i, tool in enumerate(req.tools):
        if tool.type not in (None, "custom"):
            raise unsupported(f"tools[{i}]", f"server tool {tool.type!r} (only custom tools "
                                             "with an 'input_schema')")
        if tool.input_schema is None:
            raise bad_request(f"'tools[{i}]' needs an 'input_schema'")
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        tools.append({"type": "function", "function": function})
    return tools


def _check_common(req: CountTokensRequest) -> None:
    if not req.messages:
        raise bad_request("'messages' must contain at least one message")
    if req.mcp_servers:
        raise unsupported("mcp_servers")
    thinking = req.thinking
    if thinking is not None:
        if thinking.type not in ("enabled", "disabled"):
            raise bad_request(f"'thinking.type' must be 'enabled' or 'disabled', got "
                              f"{thinking.type!r}")
        budget = thinking.budget_tokens
        if thinking.type == "enabled" and (budget is None or budget < MIN_THINKING_BUDGET):
            raise bad_request(f"'thinking.budget_tokens' must be at least "
                              f"{MIN_THINKING_BUDGET} when thinking is enabled")


def _check_messages(req: MessagesRequest) -> None:
    _check_common(req)
    if req.max_tokens < 1:
        raise bad_request(f"'max_tokens' must be at least 1, got {req.max_tokens}")
    if req.temperature is not None and not 0.0 <= req.temperature <= 1.0:
        raise bad_request(f"'temperature' must be between 0 and 1, got {req.temperature}")
    if req.stop_sequences is not None and not all(req.stop_sequences):
        raise bad_request("'stop_sequences' strings must not be empty")
    if req.top_k is not None and req.top_k < 0:
        raise bad_request(f"'top_k' must not be negative, got {req.top_k}")
    budget = req.thinking.budget_tokens if req.thinking is not None else None
    if req.thinking is not None and req.thinking.type == "enabled" and budget is not None and (
            budget >= req.max_tokens):
        raise bad_request(f"'max_tokens' ({req.max_tokens}) must be greater than "
                          f"'thinking.budget_tokens' ({budget})")
    for name in ("container", "context_management"):
        if getattr(req, name) is not None:
            raise unsupported(name)


def parse_messages(body: bytes) -> MessagesRequest:
    """Decode and check a ``POST /v1/messages`` body.

    Raises:
        HttpError: 400 for malformed JSON, wrong types, a missing field, a bad value or what
            this server does not support.
    """
    req: MessagesRequest = _decode(_messages_decoder, body)
    _check_messages(req)
    return req


def parse_count_tokens(body: bytes) -> CountTokensRequest:
    """Decode and check a ``POST /v1/messages/count_tokens`` body.

    Raises:
        HttpError: as ``parse_messages``.
    """
    req: CountTokensRequest = _decode(_count_decoder, body)
    _check_common(req)
    return req


def to_chat(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request ``req`` is (sampling and stops too when it is a ``MessagesRequest``),
    checked as the chat route checks one.

    Raises:
        HttpError: 400 for a block, role or option that has no chat equivalent here, or a value
            the chat route refuses (naming Anthropic's field: ``_api_params``).
    """
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _text_of(req.system, "system")})
    for i, message in enumerate(req.messages):
        messages += _message(i, message)
    chat: dict[str, Any] = {"model": req.model, "messages": messages}
    tools = _tools(req)
    if tools is not None:
        chat["tools"] = tools
    _tool_choice(req, chat)
    if isinstance(req, MessagesRequest):
        chat.update(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                    top_k=req.top_k, stream=req.stream)
        if req.stop_sequences:
            chat["stop"] = req.stop_sequences
    try:
        return parse_chat(msgspec.json.encode(chat))
    except HttpError as exc:  # chat's check: named as Anthropic names it
        raise messages_names(bool(req.system), req.messages).rename(exc) from None
