"""Chat's parameter names in an error, renamed to the names of the API the request came in on.

The Responses API (``/v1/responses``) and Anthropic's Messages API (``/v1/messages``) translate
their request into the internal chat request, so the checks of chat and of preprocessing name
chat's fields (``messages[2].content[0]``, ``response_format``, ``max_completion_tokens``,
``stop``). ``ParamNames.rename`` rewrites such an error before it is answered: its ``param``
and the names quoted in its message become the client's own (``input[1].content[0]``,
``text.format``, ``max_output_tokens``, ``stop_sequences``). A chat message's index maps back
to the item or message it came from (``Origin``), since the translation adds messages (the
``instructions`` or ``system`` prompt, a stored conversation) and splits or merges others.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import HttpError

__all__ = ["Origin", "ParamNames", "messages_names", "responses_names"]

_MESSAGE = re.compile(r"messages\[(\d+)\](?:\.content(?:\[(\d+)\])?)?")
#: A name quoted in an error message: 'messages[1].content[0]', 'stop', 'response_format.type'.
_QUOTED = re.compile(r"'([A-Za-z_]\w*(?:\[\d+\]|\.\w+)*)'")
#: Field renames, first match wins: (chat's, the API's); ``[i]`` stands for any index.
Fields = Sequence[tuple[str, str]]


@dataclass(frozen=True)
class Origin:
    """Where one chat message came from in the client's request.

    Attributes:
        path: the item or message (``input[2]``, ``messages[0]``, ``system``).
        content: the path of its content (``input[2].content``, ``input[3].output``).
        parts: the path of each of its content parts, when they are not ``content[j]``.
    """

    path: str
    content: str
    parts: tuple[str, ...] | None = None

    def part(self, j: int) -> str:
        if self.parts is None:
            return f"{self.content}[{j}]"
        return self.parts[j] if j < len(self.parts) else self.content


def _pattern(chat: str) -> re.Pattern[str]:
    return re.compile(re.escape(chat).replace(r"\[i\]", r"\[(\d+)\]") + r"(?=$|[.\[])")


class ParamNames:
    """The client's API's names for chat's.

    Args:
        fields: chat field prefixes and the API's (``tools[i].function`` -> ``tools[i]``).
        origins: where each chat message came from (by its index).
        phrases: unquoted text of chat's messages to replace (e.g. its option values).
    """

    def __init__(self, fields: Fields, origins: Sequence[Origin] = (),
                 phrases: Sequence[tuple[str, str]] = ()) -> None:
        self._fields = [(_pattern(chat), ours.replace("[i]", "[{}]")) for chat, ours in fields]
        self.origins = list(origins)
        self._phrases = phrases

    def path(self, chat: str) -> str:
        """The API's name for the chat parameter ``chat`` (itself when the API shares it)."""
        found = _MESSAGE.match(chat)
        if found is not None and int(found.group(1)) < len(self.origins):
            origin = self.origins[int(found.group(1))]
            rest = chat[found.end():]
            if found.group(2) is not None:
                return origin.part(int(found.group(2))) + rest
            if found.group(0).endswith(".content"):
                return origin.content + rest
            return origin.path  # a chat-only part of the message (its role, tool calls)
        for pattern, ours in self._fields:
            hit = pattern.match(chat)
            if hit is not None:
                return ours.format(*hit.groups()) + chat[hit.end():]
        return chat

    def rename(self, exc: HttpError) -> HttpError:
        """``exc`` naming the API's parameters, in ``param`` and in its message."""
        if exc.param is not None:
            exc.param = self.path(exc.param)
        message = _QUOTED.sub(lambda m: f"'{self.path(m.group(1))}'", exc.message)
        for chat, ours in self._phrases:
            message = message.replace(chat, ours)
        exc.message, exc.args = message, (message,)
        return exc


_RESPONSES_FIELDS = (
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("tools[i].function", "tools[i]"),
    ("messages", "input"),
)
#: Preprocessing's 413 messages speak of "the messages".
_RESPONSES_PHRASES = (
    ("the input messages", "the input"),
    ("the messages have", "the input has"),
    ("the messages", "the input"),
)


def responses_names(items: str | list[dict[str, Any]] | None, instructions: bool,
                    stored: int) -> ParamNames:
    """The Responses API's names: chat's messages are the ``instructions``, then ``stored``
    messages of ``previous_response_id``'s conversation, then ``input``'s items (a
    ``function_call`` after an assistant message joins it; a ``reasoning`` item is none)."""
    origins = [Origin("instructions", "instructions")] if instructions else []
    origins += [Origin("previous_response_id", "previous_response_id")] * stored
    if isinstance(items, str):
        origins.append(Origin("input", "input"))
    last = None
    for i, item in enumerate(items if isinstance(items, list) else ()):
        path = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            last = item.get("role")
            origins.append(Origin(path, f"{path}.content"))
        elif kind == "function_call" and last != "assistant":
            last = "assistant"
            origins.append(Origin(path, path))
        elif kind == "function_call_output":
            last = "tool"
            origins.append(Origin(path, f"{path}.output"))
    return ParamNames(_RESPONSES_FIELDS, origins, _RESPONSES_PHRASES)


_MESSAGES_FIELDS = (
    ("stop", "stop_sequences"),
    ("max_completion_tokens", "max_tokens"),
    ("tools[i].function.parameters", "tools[i].input_schema"),
    ("tools[i].function", "tools[i]"),
)
_MESSAGES_PHRASES = (
    ("'tool_choice' 'required'", "'tool_choice' of type 'any'"),
    ("names the function", "names the tool"),
    ("'tool_choice' 'none', 'auto', 'required' or a function", "'tool_choice' of type 'auto', "
                                                              "'any', 'tool' or 'none'"),
)
_NOT_PARTS = ("tool_use", "thinking", "redacted_thinking")


def messages_names(system: bool, messages: Sequence[Any]) -> ParamNames:
    """Anthropic's names: chat's messages are the ``system`` prompt, then each message's: a
    user's ``tool_result`` blocks (each a tool message), then its other blocks (the content
    parts); an assistant's blocks but its tool uses and thinking (its content parts).

    Args:
        messages: the request's messages (``role``, ``content``: a string or blocks with a
            ``type``).
    """
    origins = [Origin("system", "system")] if system else []
    for i, message in enumerate(messages):
        path = f"messages[{i}]"
        if isinstance(message.content, str):
            origins.append(Origin(path, f"{path}.content"))
            continue
        blocks = list(enumerate(message.content))
        if message.role == "assistant":
            parts = tuple(f"{path}.content[{j}]" for j, b in blocks if b.type not in _NOT_PARTS)
            origins.append(Origin(path, f"{path}.content", parts))
            continue
        results = [j for j, b in blocks if b.type == "tool_result"]
        origins += [Origin(f"{path}.content[{j}]", f"{path}.content[{j}].content")
                    for j in results]
        rest = tuple(f"{path}.content[{j}]" for j, b in blocks if b.type != "tool_result")
        if rest or not results:
            origins.append(Origin(path, f"{path}.content", rest))
    return ParamNames(_MESSAGES_FIELDS, origins, _MESSAGES_PHRASES)
