"""Images in KV block hashes: a block's extra key is the ``mm_hash`` of every image whose
placeholder run (``MediaItem.offset`` / ``length``) overlaps it, in prompt order (None: no
image), as vLLM's ``extra_keys`` are when it is given ``multi_modal_uuids`` equal to our
``mm_hash``. Router and mocker hash with ``media_block_hashes`` so they agree: the same image
and prompt match a worker's cached blocks; another image differs from its first block on.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from ._block_hashing import ROOT_SEED, TokenIds, block_hashes, salted_block_hashes
from ._messages import MediaItem

__all__ = ["block_extra_keys", "check_media", "media_block_hashes", "mm_hash"]


def mm_hash(data: bytes) -> str:
    """The ``MediaItem.mm_hash`` of an encoded image: its xxh3-64, 16 hex digits."""
    return xxhash.xxh3_64_hexdigest(data)


def block_extra_keys(media: Sequence[MediaItem] | None, num_blocks: int,
                     block_size: int) -> list[list[str] | None]:
    """Per block (of ``num_blocks``): the ``mm_hash`` of the images overlapping it, or None."""
    keys: list[list[str] | None] = [None] * num_blocks
    for item in media or ():
        if item.length <= 0:
            continue
        first = item.offset // block_size
        last = min((item.offset + item.length - 1) // block_size, num_blocks - 1)
        for b in range(first, last + 1):
            block = keys[b]
            if block is None:
                keys[b] = [item.mm_hash]
            else:
                block.append(item.mm_hash)
    return keys


def media_block_hashes(token_ids: TokenIds, block_size: int, parent: int | None,
                       media: Sequence[MediaItem] | None) -> list[int]:
    """The chained hashes of every full block of ``token_ids`` (from ``parent``; None: the
    root), each block an image overlaps salted with its extra key (``block_extra_keys``).

    Raises:
        ValueError: bad token ids or block size.
    """
    if not media:
        return block_hashes(token_ids, block_size, parent)
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_blocks = len(token_ids) // block_size
    keys = block_extra_keys(media, num_blocks, block_size)
    return salted_block_hashes(token_ids, block_size, ROOT_SEED if parent is None else parent,
                               keys)


def check_media(media: Sequence[MediaItem] | None, token_ids: Sequence[int],
                image_token_id: int | None) -> str | None:
    """Why ``media`` does not fit ``token_ids`` (None: it does): each item's run lies inside
    the prompt, after the previous one, holds only ``image_token_id``, and its ``mm_hash`` is
    its data's."""
    if not media:
        return None
    if image_token_id is None:
        return "this engine takes no images (no image token id)"
    end = 0
    for i, item in enumerate(media):
        if item.kind != "image":
            return f"media[{i}] is of kind {item.kind!r} (only 'image')"
        if item.length < 1 or item.offset < end or item.offset + item.length > len(token_ids):
            return (f"media[{i}]'s run [{item.offset}, {item.offset + item.length}) is not "
                    f"inside the {len(token_ids)}-token prompt after the previous image's")
        run = token_ids[item.offset : item.offset + item.length]
        if any(t != image_token_id for t in run):
            return f"media[{i}]'s run holds tokens other than the image token {image_token_id}"
        if item.mm_hash != mm_hash(item.data):
            return f"media[{i}]'s mm_hash is not the xxh3-64 of its data"
        end = item.offset + item.length
    return None
