"""``POST /v1/embeddings`` request bodies: decoded with msgspec, then validated, as
``protocol.py`` does for chat and completions.

After ``parse_embedding`` the ``input`` is a non-empty list whose items are each a string or
a non-empty list of non-negative token ids.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .errors import bad_request
from .protocol import _decode

__all__ = ["EmbeddingRequest", "parse_embedding"]

#: What ``encoding_format`` may be (OpenAI's).
ENCODINGS = ("float", "base64")


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/embeddings``; after parsing, ``input`` is a list of strings and token lists."""

    model: str
    input: str | list[Any]
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extension.
    add_special_tokens: bool | None = None


_decoder = msgspec.json.Decoder(EmbeddingRequest)
_INPUT_SHAPE = "a string, a list of strings, a list of token ids, or a list of token-id lists"


def _bad_input(message: str) -> Exception:
    return bad_request(f"'input' {message}", param="input", code="invalid_value")


def _tokens(value: list[Any], where: str) -> list[int]:
    if not value:
        raise _bad_input(f"{where}must not be an empty list of token ids")
    for token in value:
        if not isinstance(token, int) or isinstance(token, bool):
            raise _bad_input(f"must be {_INPUT_SHAPE}; {where}has {type(token).__name__} items")
        if token < 0:
            raise _bad_input(f"{where}has a negative token id {token}")
    return value


def _inputs(raw: str | list[Any]) -> list[str | list[int]]:
    if isinstance(raw, str):
        return [raw]
    if not raw:
        raise _bad_input("must not be empty")
    first = raw[0]
    if isinstance(first, int) and not isinstance(first, bool):
        return [_tokens(raw, "")]
    out: list[str | list[int]] = []
    for i, item in enumerate(raw):
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, list):
            out.append(_tokens(item, f"[{i}] "))
        else:
            raise _bad_input(f"must be {_INPUT_SHAPE}; item {i} is {type(item).__name__}")
    return out


def parse_embedding(body: bytes) -> tuple[EmbeddingRequest, list[str | list[int]]]:
    """Decode and validate an embeddings request; returns it with its inputs as a list.

    Raises:
        HttpError: 400 for malformed JSON, wrong types, missing fields or bad values, naming
            the field (``input``, ``encoding_format``, ``dimensions``).
    """
    req: EmbeddingRequest = _decode(_decoder, body)
    if req.encoding_format not in ENCODINGS:
        raise bad_request(
            f"'encoding_format' must be 'float' or 'base64', got {req.encoding_format!r}",
            param="encoding_format", code="invalid_value",
        )
    if req.dimensions is not None and req.dimensions < 1:
        raise bad_request(f"'dimensions' must be at least 1, got {req.dimensions}",
                          param="dimensions", code="invalid_value")
    return req, _inputs(req.input)
