"""``--model-path``: a model directory, or a Hugging Face hub id (``org/name``) already in the
local Hugging Face cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``). Nothing is downloaded: a
model missing from the cache is one clear error saying how to get it."""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import InvalidArgument

__all__ = ["resolve_model_path"]

#: ``org/name`` as the hub spells repository ids (one slash, no path-like start).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_model_path(value: str) -> tuple[str, str | None]:
    """The model directory ``value`` names, and the hub id it was resolved from (None for a
    directory given as such).

    Raises:
        InvalidArgument: ``value`` is neither a directory nor a hub id in the local cache.
    """
    if Path(value).is_dir():
        return value, None
    if not _HUB_ID.fullmatch(value):
        raise InvalidArgument(f"--model-path {value!r} is not a directory")
    found = _cached_snapshot(value)
    if found is None:
        raise InvalidArgument(
            f"--model-path {value!r} is neither a directory nor a model in the local Hugging "
            f"Face cache ({_cache_dir()}); download it first: hf download {value}"
        )
    return found, value


def _cached_snapshot(repo_id: str) -> str | None:
    """The cached snapshot directory of ``repo_id``'s main revision, offline; None if absent."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a dependency of tokenizers
        return None
    try:
        path = snapshot_download(repo_id, local_files_only=True)
    except (OSError, ValueError):  # not cached (LocalEntryNotFoundError), or not a valid id
        return None
    return str(path) if Path(path).is_dir() else None


def _cache_dir() -> str:
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover
        return "HF_HUB_CACHE"
    return str(constants.HF_HUB_CACHE)
