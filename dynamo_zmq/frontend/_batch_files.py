"""The Batch API's files on disk (``--batch-dir``): uploaded input files and the output and
error files of batches, as OpenAI's ``File`` objects, bounded in total size
(``--batch-max-bytes``) and deleted ``--batch-retention`` after they were created.

Layout: ``DIR/files/ID.json`` (the File object) and ``DIR/files/ID.jsonl`` (its content);
``DIR/batches/`` belongs to the runner (``_batch_runner.py``). Every file is written whole to a
temporary name and renamed, so a crash leaves the old state or the new one. One frontend
process owns a directory: it holds an exclusive lock on ``DIR/.lock`` while it runs; a second
process on the same directory gets 503 from the Batch API's routes.
"""

from __future__ import annotations

import fcntl
import os
import re
import time
import uuid
from pathlib import Path
from typing import IO, Any

import msgspec

from .errors import HttpError, bad_request

__all__ = ["FileStore", "parse_duration", "write_atomic"]

_DURATION = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([smhd]?)\s*")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_ID = re.compile(r"[A-Za-z0-9_-]{1,100}")


def parse_duration(text: str) -> float:
    """Seconds in ``text``: a number of seconds, or a number and ``s``, ``m``, ``h`` or ``d``.

    Raises:
        ValueError: anything else, or 0.
    """
    match = _DURATION.fullmatch(str(text))
    if match is None or float(match[1]) <= 0:
        raise ValueError(f"{text!r} is not a duration above 0 (e.g. 3600, 90m, 12h, 30d)")
    return float(match[1]) * _UNITS[match[2]]


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def not_found(file_id: str) -> HttpError:
    """404 for a file id this store does not hold (OpenAI's message)."""
    return HttpError(404, "invalid_request_error", f"No such File object: {file_id}",
                     param="id", code="file_not_found")


def storage_full(need: int, limit: int) -> HttpError:
    """413: storing ``need`` more bytes would take the store over ``limit``."""
    return HttpError(413, "invalid_request_error",
                     f"the batch store is full: {need} more bytes would exceed its "
                     f"{limit} bytes (--batch-max-bytes); delete files or wait for their "
                     "retention", code="storage_limit_exceeded")


class FileStore:
    """Files in ``root/files``, at most ``max_bytes`` in all (files and batch progress), each
    kept ``retention`` seconds after its creation."""

    def __init__(self, root: Path, max_bytes: int, retention: float) -> None:
        self.root, self.max_bytes, self.retention = Path(root), max_bytes, retention
        self.files = self.root / "files"
        self._lock: IO[bytes] | None = None
        self.used = 0

    @property
    def is_open(self) -> bool:
        return self._lock is not None

    def open(self) -> None:
        """Create the directory, take its lock and count what it holds.

        Raises:
            HttpError: 503 when another process holds the directory, or it cannot be made.
        """
        if self._lock is not None:
            return
        try:
            self.files.mkdir(parents=True, exist_ok=True)
            (self.root / "batches").mkdir(exist_ok=True)
            lock = (self.root / ".lock").open("ab")
        except OSError as exc:
            raise HttpError(503, "service_unavailable_error",
                            f"the batch directory {self.root} cannot be used: {exc}") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            raise HttpError(503, "service_unavailable_error",
                            f"the batch directory {self.root} is held by another frontend "
                            "process; give each frontend its own --batch-dir") from None
        self._lock = lock
        self.used = sum(p.stat().st_size for d in (self.files, self.root / "batches")
                        for p in d.iterdir() if not p.name.startswith("."))

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def reserve(self, size: int) -> None:
        """Count ``size`` more bytes (a batch's progress).

        Raises:
            HttpError: 413 when they would take the store over ``max_bytes``.
        """
        if self.used + size > self.max_bytes:
            raise storage_full(size, self.max_bytes)
        self.used += size

    def release(self, size: int) -> None:
        self.used = max(0, self.used - size)

    def add(self, filename: str, purpose: str, content: bytes) -> dict[str, Any]:
        """Store a file; its File object.

        Raises:
            HttpError: 413 when it would take the store over ``max_bytes``.
        """
        self.reserve(len(content))
        now = int(time.time())
        file_id = f"file-{uuid.uuid4().hex}"
        meta = {"id": file_id, "object": "file", "bytes": len(content), "created_at": now,
                "expires_at": now + int(self.retention), "filename": filename,
                "purpose": purpose, "status": "processed", "status_details": None}
        write_atomic(self.files / f"{file_id}.jsonl", content)
        write_atomic(self.files / f"{file_id}.json", msgspec.json.encode(meta))
        return meta

    def get(self, file_id: str) -> dict[str, Any]:
        """A file's File object.

        Raises:
            HttpError: 404 for an unknown id.
        """
        if _ID.fullmatch(file_id) is None:
            raise not_found(file_id)
        try:
            meta: dict[str, Any] = msgspec.json.decode((self.files / f"{file_id}.json")
                                                       .read_bytes())
        except (OSError, msgspec.DecodeError):
            raise not_found(file_id) from None
        return meta

    def content(self, file_id: str) -> bytes:
        """A file's bytes (404 for an unknown id)."""
        self.get(file_id)
        try:
            return (self.files / f"{file_id}.jsonl").read_bytes()
        except OSError:
            raise not_found(file_id) from None

    def delete(self, file_id: str) -> None:
        """Delete a file (404 for an unknown id)."""
        meta = self.get(file_id)
        (self.files / f"{file_id}.json").unlink(missing_ok=True)
        (self.files / f"{file_id}.jsonl").unlink(missing_ok=True)
        self.release(int(meta.get("bytes", 0)))

    def list(self, purpose: str | None = None) -> list[dict[str, Any]]:
        """The File objects, newest first (those of ``purpose`` only when given)."""
        found = []
        for path in self.files.glob("*.json"):
            try:
                meta = msgspec.json.decode(path.read_bytes())
                written = path.stat().st_mtime_ns  # the File object is written once
            except (OSError, msgspec.DecodeError):
                continue
            if purpose is None or meta.get("purpose") == purpose:
                found.append((written, meta))
        found.sort(key=lambda item: item[0], reverse=True)
        return [meta for _, meta in found]

    def expire(self, keep: set[str]) -> None:
        """Delete the files past their retention, except those in ``keep`` (a running
        batch's input)."""
        now = time.time()
        for meta in self.list():
            if meta["expires_at"] <= now and meta["id"] not in keep:
                self.delete(meta["id"])


def check_new_file(store: FileStore, size: int) -> None:
    """400 for an empty upload, 413 for one the store has no room for (before storing)."""
    if size == 0:
        raise bad_request("the uploaded file is empty", param="file")
    if store.used + size > store.max_bytes:
        raise storage_full(size, store.max_bytes)
