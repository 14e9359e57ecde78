"""OpenAI request bodies: msgspec Structs, decoded once, then validated in Python.

``parse_chat`` / ``parse_completion`` turn a request body into a ``ChatCompletionRequest`` /
``CompletionRequest`` or raise ``HttpError`` 400 with a message naming the field. Unknown fields
are ignored, as OpenAI does. Valid OpenAI options this server does not implement
(``suffix``, ``use_beam_search``, ``prompt_logprobs``, ...) are rejected with 400, never
silently ignored. Structured-output constraints are checked by ``_structured.constraint``.

After ``parse_completion`` the ``prompt`` is either a ``str`` or a ``list[int]`` (one prompt), or
a list of several of those (a batch); ``prompts(req)`` lists them either way.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from ..llm import stop_bounds_error
from ._content_parts import ImageUrl, check_content
from ._prompts import MAX_PROMPTS, parse_prompt, prompt_list
from ._structured import constraint
from ._tool_choice import validate_tool_choice
from .errors import bad_request, unsupported

__all__ = [
    "MAX_CHOICES",
    "MAX_PROMPTS",
    "MAX_SUBREQUESTS",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ContentPart",
    "FunctionCall",
    "FunctionDefinition",
    "ResponseFormat",
    "StreamOptions",
    "Tool",
    "ToolCall",
    "parse_chat",
    "parse_completion",
    "prompts",
]

_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
#: Most choices (``n``, ``best_of``) one request may ask for.
MAX_CHOICES = 128
#: Most sequences one request may generate (prompts x ``max(n, best_of)``).
MAX_SUBREQUESTS = 512


class ContentPart(msgspec.Struct):
    """One part of a message's content: ``text``, or ``image_url`` (``_content_parts.py``)."""

    type: str
    text: str | None = None
    image_url: ImageUrl | None = None


class FunctionCall(msgspec.Struct):
    name: str
    #: A JSON string, as OpenAI sends it (an object is accepted too).
    arguments: str | dict[str, Any] = ""


class ToolCall(msgspec.Struct, kw_only=True):
    function: FunctionCall
    id: str | None = None
    type: str = "function"


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    function: FunctionDefinition
    type: str = "function"


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str
    json_schema: dict[str, Any] | None = None


class _BaseRequest(msgspec.Struct, kw_only=True):
    """Fields shared by chat and completion requests (OpenAI's, then vLLM's extensions)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # vLLM extensions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    add_special_tokens: bool | None = None
    use_beam_search: bool | None = False
    prompt_logprobs: int | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    priority: int = 0  # vLLM's scheduling priority: lower runs first (_priority.py)


class ChatCompletionRequest(_BaseRequest, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    echo: bool | None = False
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    functions: Any = None
    function_call: Any = None


class CompletionRequest(_BaseRequest, kw_only=True):
    """``POST /v1/completions``; after parsing, ``prompt`` is a ``str`` or a ``list[int]``."""

    prompt: str | list[str | int | list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_PATH = re.compile(r" - at `\$\.?(.*)`$")


def _decode(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _PATH.search(text)
        if match is not None:
            param = match.group(1) or None
            text = text[: match.start()] + (f" at '{param}'" if param else "")
        else:
            missing = re.search(r"missing required field `(\w+)`", text)
            param = missing.group(1) if missing else None
        if text.startswith("Expected"):
            code = "invalid_type"
        elif "missing required field" in text:
            code = "missing_required_parameter"
        else:
            code = "invalid_value"
        raise bad_request(f"Invalid request: {text}", param=param, code=code) from exc
    except msgspec.DecodeError as exc:
        raise bad_request(
            f"The request body is not valid JSON: {exc}", code="invalid_json"
        ) from exc
    except UnicodeDecodeError as exc:  # msgspec checks UTF-8 inside strings, and raises this
        raise bad_request(
            f"The request body is not valid UTF-8: {exc.reason} at byte {exc.start}",
            code="invalid_json",
        ) from exc
    except RecursionError as exc:
        raise bad_request("The request body is nested too deeply", code="invalid_json") from exc


def _range(value: float | None, name: str, lo: float, hi: float, *, lo_open: bool = False) -> None:
    if value is None:
        return
    ok = (lo < value if lo_open else lo <= value) and value <= hi
    if not ok:
        low = f"greater than {lo}" if lo_open else f"at least {lo}"
        raise bad_request(
            f"'{name}' must be {low} and at most {hi}, got {value}",
            param=name,
            code="invalid_value",
        )


def _validate_common(req: _BaseRequest) -> None:
    _range(req.temperature, "temperature", 0.0, 2.0)
    _range(req.top_p, "top_p", 0.0, 1.0, lo_open=True)
    _range(req.min_p, "min_p", 0.0, 1.0)
    _range(req.presence_penalty, "presence_penalty", -2.0, 2.0)
    _range(req.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    _range(req.repetition_penalty, "repetition_penalty", 0.0, 2.0, lo_open=True)
    _range(req.seed, "seed", _I64_MIN, _I64_MAX)
    _range(req.max_tokens, "max_tokens", 1, _I64_MAX)
    _range(req.min_tokens, "min_tokens", 0, _I64_MAX)
    _range(req.n, "n", 1, MAX_CHOICES)
    _range(req.priority, "priority", _I64_MIN, _I64_MAX)
    if req.top_k is not None and req.top_k != -1:
        _range(req.top_k, "top_k", 0, _I64_MAX)
    if req.stop is not None:
        stops = [req.stop] if isinstance(req.stop, str) else req.stop
        if any(not s for s in stops):
            raise bad_request(
                "'stop' strings must not be empty", param="stop", code="invalid_value"
            )
        too_many = stop_bounds_error(stops)
        if too_many is not None:
            raise bad_request(f"'stop': {too_many}", param="stop", code="invalid_value")
    if (
        req.stop_token_ids
        and not 0 <= min(req.stop_token_ids) <= max(req.stop_token_ids) <= _I64_MAX
    ):
        raise bad_request(
            "'stop_token_ids' must be non-negative token ids",
            param="stop_token_ids",
            code="invalid_value",
        )
    if req.stream_options is not None and not req.stream:
        raise bad_request(
            "'stream_options' is only allowed when 'stream' is true", param="stream_options"
        )
    if req.logit_bias:
        _check_logit_bias(req.logit_bias)
    # Valid options that are not implemented yet: refuse, never ignore.
    if req.use_beam_search:
        raise unsupported("use_beam_search")
    if req.prompt_logprobs is not None:
        raise unsupported("prompt_logprobs")
    if req.spaces_between_special_tokens is False:
        raise unsupported("spaces_between_special_tokens", "only true")
    constraint(req)  # a malformed constraint is refused here, before any worker is asked


def _check_logit_bias(bias: dict[str, float]) -> None:
    """``logit_bias``: token-id strings to biases in [-100, 100], as OpenAI checks them."""
    for key, value in bias.items():
        token = int(key) if key.isascii() and key.isdigit() else -1
        if token < 0 or token > _I64_MAX:
            raise bad_request(
                f"'logit_bias' keys must be token ids (non-negative integers), got {key[:40]!r}",
                param="logit_bias",
                code="invalid_value",
            )
        if not -100.0 <= value <= 100.0:  # NaN fails too
            raise bad_request(
                f"'logit_bias' values must be between -100 and 100, got {value} for {key}",
                param="logit_bias",
                code="invalid_value",
            )


def _check_min_tokens(req: _BaseRequest, max_tokens: int | None, name: str) -> None:
    if max_tokens is not None and req.min_tokens is not None and req.min_tokens > max_tokens:
        raise bad_request(
            f"'min_tokens' ({req.min_tokens}) must not exceed '{name}' ({max_tokens})",
            param="min_tokens",
            code="invalid_value",
        )


def _validate_chat(req: ChatCompletionRequest) -> None:
    _validate_common(req)
    _range(req.max_completion_tokens, "max_completion_tokens", 1, _I64_MAX)
    if req.max_completion_tokens is not None:
        _check_min_tokens(req, req.max_completion_tokens, "max_completion_tokens")
    else:
        _check_min_tokens(req, req.max_tokens, "max_tokens")
    if not req.messages:
        raise bad_request("'messages' must contain at least one message", param="messages")
    check_content(req.messages)
    _range(req.top_logprobs, "top_logprobs", 0, 20)
    if req.top_logprobs and not req.logprobs:
        raise bad_request(
            "'top_logprobs' needs 'logprobs' set to true", param="top_logprobs",
            code="invalid_value",
        )
    if req.echo:
        raise unsupported("echo")
    if req.chat_template is not None:
        raise unsupported("chat_template", "the model's own template is always used")
    if req.modalities is not None and any(m != "text" for m in req.modalities):
        raise unsupported("modalities", "only 'text'")
    for name in ("audio", "prediction", "functions", "function_call"):
        if getattr(req, name) is not None:
            raise unsupported(name)
    if req.tools:
        for i, tool in enumerate(req.tools):
            if tool.type != "function":
                raise unsupported(f"tools[{i}].type", f"tool type {tool.type!r} (only 'function')")
    validate_tool_choice(req.tool_choice, {t.function.name for t in req.tools or ()})
    if req.continue_final_message and req.add_generation_prompt:
        raise bad_request(
            "'continue_final_message' and 'add_generation_prompt' cannot both be true",
            param="continue_final_message",
        )


def _validate_completion(req: CompletionRequest) -> None:
    _validate_common(req)
    _check_min_tokens(req, req.max_tokens, "max_tokens")
    _range(req.logprobs, "logprobs", 0, 5)
    if req.suffix is not None:
        raise unsupported("suffix")
    _range(req.best_of, "best_of", 1, MAX_CHOICES)
    n = req.n or 1
    best_of = req.best_of or n
    if best_of < n:
        raise bad_request(
            f"'best_of' ({best_of}) must be at least 'n' ({n})", param="best_of",
            code="invalid_value",
        )
    if best_of > n and req.stream:
        raise bad_request(
            "'best_of' greater than 'n' cannot be streamed", param="best_of",
            code="invalid_value",
        )
    # a list[int] is a valid value of the field, but lists are invariant to mypy
    req.prompt = parse_prompt(req.prompt)  # type: ignore[assignment]
    count = len(prompts(req))
    if count * best_of > MAX_SUBREQUESTS:
        raise bad_request(
            f"{count} prompts x {best_of} sequences is more than the {MAX_SUBREQUESTS} sequences "
            "one request may generate", param="prompt" if count > 1 else "best_of",
            code="invalid_value",
        )


def prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a parsed completion request (one, or the batch's in order)."""
    return prompt_list(req.prompt)


def parse_chat(body: bytes) -> ChatCompletionRequest:
    """Decode and validate a chat completion request.

    Raises:
        HttpError: 400 for malformed JSON, wrong types, missing fields, bad values or
            unsupported options.
    """
    req: ChatCompletionRequest = _decode(_chat_decoder, body)
    _validate_chat(req)
    return req


def parse_completion(body: bytes) -> CompletionRequest:
    """Decode and validate a completion request; ``prompt`` becomes a ``str`` or ``list[int]``.

    Raises:
        HttpError: 400 for malformed JSON, wrong types, missing fields, bad values or
            unsupported options (including a batch of several prompts).
    """
    req: CompletionRequest = _decode(_completion_decoder, body)
    _validate_completion(req)
    return req
