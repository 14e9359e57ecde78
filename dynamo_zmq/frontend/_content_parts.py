"""Chat message content parts: ``text`` and ``image_url`` (OpenAI's shapes), checked once.

``{"type": "text", "text": ...}`` and, in user messages, ``{"type": "image_url", "image_url":
{"url": ..., "detail": ...}}`` with a ``data:`` URL or an ``http(s)`` URL (whether a remote
URL may be fetched, and what the image holds, ``_images.py`` decides). Any other part type is
refused with 400 naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from .errors import bad_request, unsupported

__all__ = ["DETAILS", "ImageUrl", "check_content", "image_urls"]

#: ``image_url.detail`` values OpenAI accepts (the engines here read none of them).
DETAILS = frozenset({"auto", "low", "high"})
_SCHEMES = ("data:", "http://", "https://")


class ImageUrl(msgspec.Struct):
    """An ``image_url`` part's image: a data URL or an http(s) URL."""

    url: str
    detail: str | None = None


def check_content(messages: Sequence[Any]) -> None:
    """Check every message's content parts (``protocol.ChatMessage``).

    Raises:
        HttpError: 400 naming the part that is malformed, of a type not supported, or an
            image outside a user message.
    """
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            param = f"messages[{i}].content[{j}]"
            if part.type == "text":
                if part.text is None:
                    raise bad_request(
                        f"'{param}' of type 'text' needs a 'text' string", param=param
                    )
            elif part.type == "image_url":
                _check_image(part.image_url, message.role, param)
            else:
                raise unsupported(
                    param, f"content part type {part.type!r} (only 'text' and 'image_url')"
                )


def _check_image(image: ImageUrl | None, role: str, param: str) -> None:
    if image is None:
        raise bad_request(f"'{param}' of type 'image_url' needs an 'image_url' object with a "
                          "'url'", param=param)
    if role != "user":
        raise bad_request(f"'{param}': images are only allowed in user messages, not "
                          f"{role!r}", param=param)
    if image.detail is not None and image.detail not in DETAILS:
        raise bad_request(f"'{param}.image_url.detail' must be 'auto', 'low' or 'high', got "
                          f"{image.detail[:40]!r}", param=f"{param}.image_url.detail",
                          code="invalid_value")
    if not image.url.lower().startswith(_SCHEMES):
        raise bad_request(f"'{param}.image_url.url' must be a data: URL or an http(s) URL",
                          param=f"{param}.image_url.url", code="invalid_value")


def image_urls(messages: Sequence[Any]) -> list[tuple[str, str]]:
    """The request's images in prompt order: (the part's param, its URL)."""
    out: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if part.type == "image_url" and part.image_url is not None:
                    out.append((f"messages[{i}].content[{j}].image_url.url", part.image_url.url))
    return out
