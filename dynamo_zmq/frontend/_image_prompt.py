"""A chat prompt with images: rendered, tokenized, each image expanded into its run of
placeholder tokens (``MediaItem``).

The template first gets Hugging Face's image parts (``{"type": "image"}``) when the engine's
image token is one of the tokenizer's added tokens: if the rendering holds that token's text
once per image, each occurrence is where an image goes. Otherwise (a template that refuses or
ignores image parts) each image is a marker in the message's text, at the part's position.
The text between images is tokenized piece by piece; each image becomes
``EngineConfig.tokens_per_image`` copies of ``EngineConfig.image_token_id``, so prompt-length
checks, block hashes, routing and the engine all count the same positions. With the engine's
own tokenizer (native processing), the image token ids its template writes are expanded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tokenizers import Tokenizer

from ..llm import MediaItem
from ..llm._media_keys import mm_hash
from ._chat_template import message_dict
from ._limits import PromptBound, text_chars
from ._model_files import NativeTokenizerLike
from .errors import HttpError, bad_request, unsupported
from .protocol import ChatCompletionRequest

__all__ = ["MARKER", "ImagePreprocessor", "Vision", "image_chat"]

#: Stands for an image in the rendering of a template that ignores image parts.
MARKER = "\x00<dynamo-zmq:image>\x00"


class ImagePreprocessor(PromptBound, Protocol):
    """What a prompt with images needs of the model's ``Preprocessor``."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def native(self) -> NativeTokenizerLike | None: ...

    def render(self, req: ChatCompletionRequest,
               messages: list[dict[str, Any]] | None = None) -> str:
        """The chat prompt text of ``req`` (its ``messages`` as given)."""

    def native_chat(self, req: ChatCompletionRequest,
                    messages: list[dict[str, Any]] | None = None) -> list[int]:
        """``req``'s prompt by the engine's own template (its ``messages`` as given)."""


@dataclass(frozen=True)
class Vision:
    """How the serving engine takes images (its ``EngineConfig``)."""

    image_token_id: int
    tokens_per_image: int


def image_chat(pre: ImagePreprocessor, req: ChatCompletionRequest, images: Sequence[bytes],
               vision: Vision) -> tuple[list[int], list[MediaItem]]:
    """The prompt's token ids with each image's run, and the images as ``MediaItem``.

    Raises:
        HttpError: 400 (the template loses an image, tokenization fails), 413 (too long).
    """
    if req.continue_final_message:
        raise unsupported("continue_final_message", "with images")
    if pre.native is not None:
        return _native(pre, req, images, vision)
    segments = _segments(pre, req, len(images), vision)
    text_chars(pre, [("messages", "".join(segments))])
    tok = pre.tokenizer
    try:
        pieces = [e.ids for e in tok.encode_batch_fast(segments, add_special_tokens=False)]
        if req.add_special_tokens:  # only the prompt's start gets them
            pieces[0] = tok.encode_batch_fast(segments[:1], add_special_tokens=True)[0].ids
    except Exception as exc:  # tokenizers raises plain exceptions on odd input
        raise bad_request(f"The messages could not be tokenized: {exc}",
                          param="messages") from exc
    ids: list[int] = []
    media: list[MediaItem] = []
    for k, piece in enumerate(pieces):
        ids += piece
        if k < len(images):
            media.append(_item(images[k], len(ids), vision))
            ids += [vision.image_token_id] * vision.tokens_per_image
    return ids, media


def _item(data: bytes, offset: int, vision: Vision) -> MediaItem:
    return MediaItem(data, mm_hash(data), offset, vision.tokens_per_image)


def _segments(pre: ImagePreprocessor, req: ChatCompletionRequest, n: int,
              vision: Vision) -> list[str]:
    """The rendered prompt cut at its ``n`` images."""
    added = pre.tokenizer.get_added_tokens_decoder().get(vision.image_token_id)
    if added is not None:
        try:
            text = pre.render(req, [message_dict(m, parts=True) for m in req.messages])
        except HttpError:  # a template that takes text content only
            text = ""
        segments = text.split(added.content)
        if len(segments) == n + 1:
            return segments
    text = pre.render(req, [message_dict(m, MARKER) for m in req.messages])
    segments = text.split(MARKER)
    if len(segments) != n + 1:
        raise bad_request(f"The chat template rendered {len(segments) - 1} of the request's "
                          f"{n} images", param="messages")
    return segments


def _native(pre: ImagePreprocessor, req: ChatCompletionRequest, images: Sequence[bytes],
            vision: Vision) -> tuple[list[int], list[MediaItem]]:
    """The engine's own template's token ids, each image token it writes expanded."""
    raw = pre.native_chat(req, [message_dict(m, parts=True) for m in req.messages])
    at = [i for i, t in enumerate(raw) if t == vision.image_token_id]
    if len(at) != len(images):
        raise bad_request(f"The engine's chat template wrote {len(at)} image tokens for the "
                          f"request's {len(images)} images", param="messages")
    ids: list[int] = []
    media: list[MediaItem] = []
    start = 0
    for data, i in zip(images, at, strict=True):
        ids += raw[start:i]
        media.append(_item(data, len(ids), vision))
        ids += [vision.image_token_id] * vision.tokens_per_image
        start = i + 1
    ids += raw[start:]
    return ids, media
