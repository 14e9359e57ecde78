"""``POST /v1/responses`` request side: the OpenAI Responses body decoded and translated into
the internal chat request (``protocol.ChatCompletionRequest``), so preprocessing, tools,
structured outputs and the parsers are chat's.

``input`` (a string, or a list of items: messages with ``input_text`` / ``output_text``
content, ``function_call`` and ``function_call_output`` items, ``reasoning`` items) becomes
chat messages; ``instructions`` a leading system message; ``max_output_tokens``,
``temperature``, ``top_p``, ``tools`` (functions), ``tool_choice``, ``parallel_tool_calls``
and ``text.format`` (``json_schema`` / ``json_object``) chat's fields. Options this server does
not implement are refused with 400 (``unsupported``), never ignored.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .errors import bad_request, unsupported
from .protocol import ChatCompletionRequest, _decode, parse_chat

__all__ = ["ResponsesRequest", "input_messages", "parse_responses", "to_chat"]

_I64_MAX = 2**63 - 1


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """The Responses fields this server reads (unknown fields are ignored, as OpenAI does)."""

    model: str
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Refused when set (not implemented).
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    background: bool | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None


_decoder = msgspec.json.Decoder(ResponsesRequest)


def _refuse_unimplemented(req: ResponsesRequest) -> None:
    if req.reasoning and any(v is not None for v in req.reasoning.values()):
        raise unsupported("reasoning", "reasoning options (the model's parser decides)")
    if req.include:
        raise unsupported("include")
    if req.background:
        raise unsupported("background")
    if req.truncation not in (None, "disabled"):
        raise unsupported("truncation", "only 'disabled'")
    for name in ("top_logprobs", "conversation", "prompt", "max_tool_calls"):
        if getattr(req, name) is not None:
            raise unsupported(name)


def _range(value: float | None, name: str, lo: float, hi: float, lo_open: bool = False) -> None:
    if value is None:
        return
    if not ((lo < value if lo_open else lo <= value) and value <= hi):
        low = f"greater than {lo}" if lo_open else f"at least {lo}"
        raise bad_request(f"'{name}' must be {low} and at most {hi}, got {value}", param=name,
                          code="invalid_value")


def parse_responses(body: bytes) -> ResponsesRequest:
    """Decode and check a Responses request.

    Raises:
        HttpError: 400 for malformed JSON, wrong types, bad values or unsupported options.
    """
    req: ResponsesRequest = _decode(_decoder, body)  # chat's decoding errors
    _refuse_unimplemented(req)
    _range(req.max_output_tokens, "max_output_tokens", 1, _I64_MAX)
    _range(req.temperature, "temperature", 0.0, 2.0)
    _range(req.top_p, "top_p", 0.0, 1.0, lo_open=True)
    if isinstance(req.input, str) and not req.input and req.previous_response_id is None:
        raise bad_request("'input' must not be empty", param="input",
                          code="missing_required_parameter")
    return req


def _text(content: Any, param: str) -> str | list[dict[str, Any]]:
    """A message's content for chat: a string, or its ``input_text`` / ``output_text`` parts
    as chat's text parts and its ``input_image`` parts as chat's ``image_url`` parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{param}' must be a string or a list of content parts", param=param,
                          code="invalid_type")
    texts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            texts.append(_image(part, f"{param}[{j}]"))
            continue
        if kind not in ("input_text", "output_text", "text"):
            raise unsupported(f"{param}[{j}]", f"content part type {kind!r} (only "
                                               "'input_text', 'output_text' and 'input_image')")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request(f"'{param}[{j}].text' must be a string", param=f"{param}[{j}]",
                              code="invalid_type")
        texts.append({"type": "text", "text": text})
    return texts


def _image(part: dict[str, Any], param: str) -> dict[str, Any]:
    """An ``input_image`` part as chat's ``image_url`` part (its URL: a data URL or http(s))."""
    url, detail = part.get("image_url"), part.get("detail")
    if not isinstance(url, str):
        raise bad_request(f"'{param}.image_url' must be a string (a data URL or an http(s) "
                          "URL; 'file_id' is not supported)", param=f"{param}.image_url",
                          code="invalid_type")
    image = {"url": url} if detail is None else {"url": url, "detail": detail}
    return {"type": "image_url", "image_url": image}


def _function_call(item: dict[str, Any], param: str) -> dict[str, Any]:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise bad_request(f"'{param}.{key}' must be a string", param=f"{param}.{key}",
                              code="invalid_type")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def _reasoning(item: dict[str, Any], param: str) -> str:
    """A ``reasoning`` item's text: its ``content`` parts', else its ``summary`` parts'."""
    key = "content" if item.get("content") else "summary"
    parts = item.get(key) or []
    if not isinstance(parts, list) or not all(
            isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in parts):
        raise bad_request(f"'{param}.{key}' must be a list of parts with a 'text' string",
                          param=f"{param}.{key}", code="invalid_type")
    return "".join(p.get("text", "") for p in parts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages (``function_call`` items after an assistant message, or
    after each other: that message's tool calls; a ``reasoning`` item: the next assistant
    message's reasoning).

    Raises:
        HttpError: 400 naming the item that is malformed or of a type not supported.
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}] if items else []
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None
    for i, item in enumerate(items):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"'{param}.role' must be 'user', 'system', 'developer' or "
                                  f"'assistant', got {role!r}", param=f"{param}.role",
                                  code="invalid_value")
            message: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                       "content": _text(item.get("content"), f"{param}.content")}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            call = _function_call(item, param)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # its text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    message["reasoning_content"], reasoning = reasoning, None
                messages.append(message)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"'{param}.call_id' must be a string",
                                  param=f"{param}.call_id", code="invalid_type")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item.get("output"), f"{param}.output")})
        elif kind == "reasoning":
            reasoning = _reasoning(item, param)
        else:
            raise unsupported(f"{param}.type", f"input item type {kind!r} (only 'message', "
                                               "'function_call', 'function_call_output' and "
                                               "'reasoning')")
    return messages


def _tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise unsupported(f"tools[{i}].type",
                              f"tool type {tool.get('type')!r} (only 'function')")
        if not isinstance(tool.get("name"), str):
            raise bad_request(f"'tools[{i}].name' must be a string", param=f"tools[{i}].name",
                              code="invalid_type")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                    if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise unsupported("tool_choice", "only 'auto', 'none', 'required' or "
                                             "{'type': 'function', 'name': ...}")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("'text.format' must be an object", param="text.format",
                          code="invalid_type")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise bad_request(f"'text.format.type' must be 'text', 'json_object' or 'json_schema', "
                          f"got {kind!r}", param="text.format.type", code="invalid_value")
    if not isinstance(fmt.get("schema"), dict):
        raise bad_request("'text.format' of type 'json_schema' needs a 'schema' object",
                          param="text.format.schema", code="missing_required_parameter")
    schema = {k: fmt[k] for k in ("name", "schema", "strict") if fmt.get(k) is not None}
    return {"type": "json_schema", "json_schema": schema}


def to_chat(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The internal chat request: ``instructions``, then ``conversation`` (the previous
    response's conversation and ``input``, as chat messages: ``input_messages``).

    Raises:
        HttpError: 400 for what the Responses or the chat checks refuse.
    """
    messages = list(conversation)
    if not messages:
        raise bad_request("'input' must not be empty", param="input",
                          code="missing_required_parameter")
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": bool(req.stream)}
    for ours, theirs in (("max_completion_tokens", req.max_output_tokens),
                         ("temperature", req.temperature), ("top_p", req.top_p),
                         ("parallel_tool_calls", req.parallel_tool_calls), ("user", req.user)):
        if theirs is not None:
            body[ours] = theirs
    if req.tools:
        body["tools"] = _tools(req.tools)
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    if (fmt := _response_format(req.text)) is not None:
        body["response_format"] = fmt
    return parse_chat(msgspec.json.encode(body))

