"""Reading a model's tokenizer and config files for the ``Preprocessor``: JSON files that may
be missing, special tokens as ``tokenizer_config.json`` stores them, token-id lists, and the
longest vocabulary entry (which bounds how much text one token can stand for)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from tokenizers import Tokenizer

__all__ = ["SPECIAL_TOKENS", "NativeTokenizerLike", "id_list", "longest_token", "read_json",
           "token_text", "unique"]

SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
    "additional_special_tokens",
)


class NativeTokenizerLike(Protocol):
    """The tokenizer-adapter interface of native processing: an engine's own tokenizer and chat
    template (e.g. ``engines.vllm.native.NativeTokenizer``)."""

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True, **kwargs: Any,
    ) -> list[int]: ...

    def encode(self, text: str) -> list[int]: ...


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path`` ({} when the file is missing or holds something else)."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def token_text(value: Any) -> Any:
    """A special token as tokenizer_config stores it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    if isinstance(value, list):
        return [token_text(v) for v in value]
    return value


def id_list(value: Any) -> list[int]:
    """Token ids stored as one int or a list of them (anything else: none)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def unique(values: Iterable[int]) -> list[int]:
    """``values`` without repeats, in order."""
    return list(dict.fromkeys(values))


def longest_token(tokenizer: Tokenizer) -> int:
    """The length of the longest vocabulary entry (added tokens included), in characters.

    A byte-level BPE entry has one character per byte of the text it stands for, and a
    SentencePiece entry one per character (``▁`` for a space), so no token covers more
    characters of a prompt than this.
    """
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return max(map(len, vocab), default=1)
