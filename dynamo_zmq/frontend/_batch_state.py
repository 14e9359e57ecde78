"""A batch and its state on disk (``DIR/batches``): ``ID.json`` holds its ``Batch`` object,
its tenant and when it was made, rewritten whole (temporary file and rename) at each change of
status; ``ID.progress.jsonl`` gets one line per finished request as it finishes (a line torn
by a crash is dropped when the batch is read back)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import msgspec

from ._batch_files import write_atomic

__all__ = ["ACTIVE", "Batch", "load_batches"]

log = logging.getLogger(__name__)

#: The statuses of a batch that is not over.
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")


class Batch:
    """One batch: its ``Batch`` object, its tenant, and the answers of its finished lines
    (``done``), kept in ``directory``."""

    def __init__(self, directory: Path, obj: dict[str, Any], tenant: str | None,
                 created: float) -> None:
        self.directory, self.obj, self.tenant, self.created = directory, obj, tenant, created
        self.done: dict[int, dict[str, Any]] = {}  # line number: its output line
        self.task: asyncio.Task[None] | None = None
        self.halt = asyncio.Event()  # set: the lines in flight are abandoned
        self.recording = True  # False: the frontend is stopping, answers are not kept
        self.resumed = False  # read back from the directory at the frontend's start

    @property
    def id(self) -> str:
        return str(self.obj["id"])

    @property
    def progress(self) -> Path:
        return self.directory / f"{self.id}.progress.jsonl"

    def is_ok(self, out: dict[str, Any]) -> bool:
        """Whether an output line is a success (a 2xx answer)."""
        return out["error"] is None and 200 <= out["response"]["status_code"] < 300

    def count(self, total: int | None = None) -> None:
        """Update ``request_counts`` from the finished lines."""
        ok = sum(1 for out in self.done.values() if self.is_ok(out))
        counts = self.obj["request_counts"]
        counts.update(completed=ok, failed=len(self.done) - ok)
        if total is not None:
            counts["total"] = total

    def save(self) -> None:
        """Write ``ID.json`` (atomically)."""
        write_atomic(self.directory / f"{self.id}.json", msgspec.json.encode(
            {"batch": self.obj, "tenant": self.tenant, "created": self.created}))

    def append(self, number: int, out: dict[str, Any], data: bytes) -> None:
        """Keep line ``number``'s output line ``out`` (``data``: its progress record)."""
        with self.progress.open("ab") as f:
            f.write(data)
        self.done[number] = out
        self.count()

    def load_progress(self) -> None:
        """Read back the lines the progress file holds (truncating a torn last one)."""
        if not self.progress.exists():
            return
        raw = self.progress.read_bytes()
        good = 0
        for chunk in raw.split(b"\n")[:-1]:  # the last: empty, or torn by a crash
            try:
                item = msgspec.json.decode(chunk)
            except msgspec.DecodeError:
                break
            self.done[int(item["line"])] = item["out"]
            good += len(chunk) + 1
        if good < len(raw):
            with self.progress.open("r+b") as f:
                f.truncate(good)
        self.count()


def progress_record(number: int, out: dict[str, Any]) -> bytes:
    """Line ``number``'s record in the progress file."""
    return msgspec.json.encode({"line": number, "out": out}) + b"\n"


def load_batches(directory: Path) -> list[Batch]:
    """The batches ``directory`` holds (an unfinished one with its answered lines)."""
    found = []
    for path in sorted(directory.glob("*.json")):
        try:
            saved = msgspec.json.decode(path.read_bytes())
            batch = Batch(directory, saved["batch"], saved.get("tenant"),
                          float(saved["created"]))
        except (OSError, msgspec.DecodeError, KeyError, TypeError, ValueError):
            log.warning("Batch API: %s is not a batch; left alone", path)
            continue
        if batch.obj["status"] in ACTIVE:
            batch.load_progress()
        found.append(batch)
    return found
