"""Model deployment cards: what a frontend needs to serve a model, without a shared filesystem.

A worker builds a ``ModelCard`` from its model directory and publishes it in its endpoint
metadata. The card names the tokenizer files with their sizes and digests; the files themselves
are served by the worker's ``model_files`` endpoint, so a frontend on another host fetches them
once, checks them against the card's checksum, and caches them by checksum.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import msgspec

__all__ = ["CARD_FILES", "CHUNK", "CardFile", "ModelCard", "build_card", "read_card_file"]

#: Files a frontend may need for preprocessing (those that exist are served).
CARD_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)

#: Bytes per item when a file is streamed.
CHUNK = 256 * 1024


class CardFile(msgspec.Struct, omit_defaults=True):
    name: str
    size: int
    sha256: str


class ModelCard(msgspec.Struct, omit_defaults=True):
    """The model as frontends see it."""

    name: str
    checksum: str
    context_length: int = 0
    kv_block_size: int = 0
    files: list[CardFile] = msgspec.field(default_factory=list)
    #: The worker's disaggregation role: agg, prefill or decode.
    role: str = "agg"
    extra: dict[str, Any] = msgspec.field(default_factory=dict)


def build_card(
    model_path: str | Path,
    name: str,
    *,
    context_length: int = 0,
    kv_block_size: int = 0,
    role: str = "agg",
) -> ModelCard:
    """Describe the tokenizer files of ``model_path``; the checksum covers their names and bytes."""
    root = Path(model_path)
    files: list[CardFile] = []
    total = hashlib.sha256()
    for fname in CARD_FILES:
        path = root / fname
        if not path.is_file():
            continue
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        files.append(CardFile(fname, len(data), digest))
        total.update(fname.encode() + b"\0" + digest.encode() + b"\0")
    return ModelCard(
        name=name,
        checksum=total.hexdigest(),
        context_length=context_length,
        kv_block_size=kv_block_size,
        files=files,
        role=role,
    )


def read_card_file(model_path: str | Path, card: ModelCard, name: str) -> bytes:
    """The bytes of a file the card lists; ValueError for anything else (no path tricks)."""
    if name not in {f.name for f in card.files}:
        raise ValueError(f"{name!r} is not a file of model {card.name!r}")
    return (Path(model_path) / name).read_bytes()
