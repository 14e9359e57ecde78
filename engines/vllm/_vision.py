"""Images for vLLM: what a multimodal model advertises (``Capability.VISION`` with
``EngineConfig.image_token_id`` and ``tokens_per_image``) and a request's images as vLLM's
token-prompt inputs.

The frontend expands each image into ``tokens_per_image`` copies of the image token
(``MediaItem.offset``/``length``). vLLM (0.32) does not recognise an already-expanded run in
token inputs: it applies the model's prompt update (one ``<image>`` -> the run) to the first
image token it finds, whatever follows. So each run is collapsed back to the one token vLLM
expects, and vLLM expands it again, to the same positions: its token ids, KV blocks and events
match the frontend's and the router's. Each image goes with its ``mm_hash`` as vLLM's
multimodal UUID, which vLLM uses as its cache key and in its KV events' ``extra_keys``.

The model type handled is LLaVA (``model_type`` ``llava``: ``image_token_index`` and a
fixed-size vision tower, one token a patch, the class token dropped unless the feature strategy
is ``full``); another multimodal model (LLaVA-NeXT's variable tiles included) is served
text-only (no ``vision`` capability, a warning).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Sequence
from typing import Any

from dynamo_zmq import errors
from dynamo_zmq.llm import EngineConfig, MediaItem

__all__ = ["collapse_runs", "decode_images", "image_placeholders", "mm_inputs", "prompt_inputs"]

log = logging.getLogger("engines.vllm")


def image_placeholders(model_config: Any) -> tuple[int, int] | None:
    """``(image_token_id, tokens_per_image)`` of a multimodal model vLLM runs, or None (text
    model, or a multimodal config this adapter cannot size)."""
    if not getattr(model_config, "is_multimodal_model", False):
        return None
    hf = model_config.hf_config
    token = getattr(hf, "image_token_index", None)
    if token is None:
        token = getattr(hf, "image_token_id", None)
    vision = getattr(hf, "vision_config", None)
    size = getattr(vision, "image_size", None)
    patch = getattr(vision, "patch_size", None)
    kind = getattr(hf, "model_type", None)
    if (kind != "llava" or not isinstance(token, int) or not isinstance(size, int)
            or not isinstance(patch, int)):
        log.warning("vLLM model %s is multimodal but not LLaVA (model type %r, image token %r, "
                    "image size %r, patch %r): served without images", model_config.model, kind,
                    token, size, patch)
        return None
    count = (size // patch) ** 2
    if getattr(hf, "vision_feature_select_strategy", "default") == "full":
        count += 1  # the class token stays
    return token, count


def collapse_runs(token_ids: Sequence[int], media: Sequence[MediaItem], image_token_id: int,
                  tokens_per_image: int) -> list[int]:
    """``token_ids`` with each image's run replaced by one ``image_token_id`` (what vLLM
    expands).

    Raises:
        InvalidArgument: a run outside the prompt, overlapping the previous one, of another
            length than ``tokens_per_image``, holding other tokens; an image token outside runs.
    """
    out: list[int] = []
    end = 0
    for i, item in enumerate(media):
        stop = item.offset + item.length
        if item.kind != "image":
            raise errors.InvalidArgument(f"media[{i}] is of kind {item.kind!r} (only 'image')")
        if item.length != tokens_per_image or item.offset < end or stop > len(token_ids):
            raise errors.InvalidArgument(
                f"media[{i}]'s run [{item.offset}, {stop}) is not {tokens_per_image} tokens "
                f"inside the {len(token_ids)}-token prompt after the previous image's")
        if any(t != image_token_id for t in token_ids[item.offset:stop]):
            raise errors.InvalidArgument(
                f"media[{i}]'s run holds tokens other than the image token {image_token_id}")
        out.extend(token_ids[end:item.offset])
        out.append(image_token_id)
        end = stop
    out.extend(token_ids[end:])
    if out.count(image_token_id) != len(media):
        raise errors.InvalidArgument(
            f"the prompt holds image token {image_token_id} outside the runs of its "
            f"{len(media)} image(s)")
    return out


def decode_images(media: Sequence[MediaItem]) -> list[Any]:
    """Each item's encoded image as an RGB ``PIL.Image``.

    Raises:
        InvalidArgument: data that is not an image PIL can read.
    """
    from PIL import Image, UnidentifiedImageError

    images = []
    for i, item in enumerate(media):
        try:
            with Image.open(io.BytesIO(item.data)) as img:
                images.append(img.convert("RGB"))
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise errors.InvalidArgument(f"media[{i}] is not a readable image: {exc}") from exc
    return images


def mm_inputs(token_ids: Sequence[int], media: Sequence[MediaItem], image_token_id: int,
              tokens_per_image: int) -> dict[str, Any]:
    """vLLM's ``TokensPrompt`` fields for a prompt with images: collapsed token ids, the PIL
    images and their ``mm_hash`` as multimodal UUIDs."""
    return {
        "prompt_token_ids": collapse_runs(token_ids, media, image_token_id, tokens_per_image),
        "multi_modal_data": {"image": decode_images(media)},
        "multi_modal_uuids": {"image": [item.mm_hash for item in media]},
    }


def prompt_inputs(token_ids: Sequence[int], media: Sequence[MediaItem] | None,
                  config: EngineConfig | None) -> Any:
    """vLLM's ``TokensPrompt`` for a request (with ``mm_inputs`` when it has images).

    Raises:
        Unsupported: images for a model served without them (``image_placeholders`` None).
        InvalidArgument: see ``mm_inputs``.
    """
    from vllm.inputs import TokensPrompt

    if not media:
        return TokensPrompt(prompt_token_ids=list(token_ids))
    if config is None or config.image_token_id is None or config.tokens_per_image <= 0:
        name = config.served_model_name if config is not None else "the model"
        raise errors.Unsupported(f"this vLLM engine's model {name!r} takes no images (it is "
                                 "not a LLaVA-style vision-language model)")
    return TokensPrompt(**mm_inputs(  # type: ignore[typeddict-item]
        token_ids, media, config.image_token_id, config.tokens_per_image))
