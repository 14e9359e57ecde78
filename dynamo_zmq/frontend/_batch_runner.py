"""Running batches: each batch's lines go through the frontend's own handlers
(``_batch_call.py``), at most ``--batch-concurrency`` lines in flight on this frontend (all
batches together), at the lowest priority.

State on disk: ``_batch_state.py`` (each finished line is written as it finishes). When a batch
ends, its answers become its output file (the 2xx answers) and error file (the others), in
OpenAI's line shape ``{id, custom_id, response: {status_code, request_id, body}, error}``,
ordered as the input.

Restart: a frontend that opens a directory resumes every batch it finds unfinished, without
sending again the lines its progress file has answered (a line in flight when the process died
has no answer there and is sent again); a batch being cancelled ends cancelled. A line whose
answer is 503 or 429 (no worker yet, busy, a tenant's rate) is tried again after a pause until
the batch's completion window ends; so is a resumed batch's line whose model is unknown in the
frontend's first ``DISCOVERY_GRACE`` seconds (a restarted frontend resumes before it has found
its workers).
Lines not answered when the window (24h) ends get an error line with code ``batch_expired``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge

from ..resources import cancel_and_wait
from ._batch_call import App, call_in_process
from ._batch_files import FileStore
from ._batch_input import BatchLine, parse_lines
from ._batch_state import ACTIVE, Batch, load_batches, progress_record
from .errors import HttpError, from_exception

if TYPE_CHECKING:
    from ._batch_args import BatchConfig

__all__ = ["ACTIVE", "BatchRunner"]

log = logging.getLogger(__name__)

WINDOW = 24 * 3600
_RETRY = (429, 503)
#: Seconds after the frontend's start in which a batch line for a model it does not know yet
#: is tried again (its workers are still being discovered).
DISCOVERY_GRACE = 30.0
_EXPIRED = {"code": "batch_expired",
            "message": "This request could not be executed before the completion window "
                       "expired."}


class BatchRunner:
    """The batches of one frontend process and the directory they live in."""

    def __init__(self, app: App, registry: CollectorRegistry, config: BatchConfig) -> None:
        """``app``: the frontend's ASGI app (each line is sent to it); ``registry``: its
        metrics'."""
        self.app, self.config = app, config
        self.store = FileStore(config.root, config.max_bytes, config.retention)
        self.batches: dict[str, Batch] = {}
        self._slots = asyncio.Semaphore(config.concurrency)
        self._sweeper: asyncio.Task[None] | None = None
        r = registry
        self.in_flight = Gauge("dynamo_frontend_batch_requests_in_flight",
                               "Batch requests this frontend has in flight", registry=r)
        self.peak = Gauge("dynamo_frontend_batch_requests_in_flight_peak",
                          "Most batch requests this frontend had in flight at once", registry=r)
        self.finished = Counter("dynamo_frontend_batch_requests",
                                "Batch requests answered, by status (ok: 2xx, error: others)",
                                ["status"], registry=r)
        self._now_in_flight = self._peak = 0
        self._grace_end = time.monotonic() + DISCOVERY_GRACE

    @property
    def dir(self) -> Path:
        return self.store.root / "batches"

    # -- life ------------------------------------------------------------------------------

    def start(self) -> None:
        """At the frontend's start: open the directory if it exists (resuming its batches)."""
        if self.config.root.is_dir():
            try:
                self.open()
            except HttpError as exc:
                log.warning("Batch API: %s", exc.message)

    def open(self) -> None:
        """Open the directory (at the first use, or the start): resume unfinished batches and
        start the retention sweep.

        Raises:
            HttpError: 503 when another process holds the directory.
        """
        if self.store.is_open:
            return
        self.store.open()
        for batch in load_batches(self.dir):
            self.batches[batch.id] = batch
            if batch.obj["status"] in ACTIVE:
                batch.resumed = True
                if batch.obj["status"] == "cancelling":  # it ends cancelled, sending no more
                    batch.halt.set()
                log.info("Batch API: resuming batch %s (%d lines answered before)", batch.id,
                         len(batch.done))
                self._launch(batch)
        self._sweeper = asyncio.ensure_future(self._sweep())

    async def stop(self) -> None:
        """At shutdown: abandon the lines in flight (unrecorded: a restart sends them again)."""
        tasks: list[asyncio.Task[Any]] = [self._sweeper] if self._sweeper else []
        for batch in self.batches.values():
            batch.recording = False
            batch.halt.set()
            if batch.task is not None:
                tasks.append(batch.task)
        await cancel_and_wait(tasks)
        self.store.close()

    def _launch(self, batch: Batch) -> None:
        batch.task = asyncio.ensure_future(self._run(batch))

    # -- the API ---------------------------------------------------------------------------

    def create(self, input_file_id: str, endpoint: str, metadata: dict[str, str] | None,
               tenant: str | None, lines: list[BatchLine]) -> Batch:
        """A new batch over checked ``lines``, started."""
        now = int(time.time())
        obj: dict[str, Any] = {
            "id": f"batch_{uuid.uuid4().hex}", "object": "batch", "endpoint": endpoint,
            "errors": None, "input_file_id": input_file_id, "completion_window": "24h",
            "status": "validating", "output_file_id": None, "error_file_id": None,
            "created_at": now, "in_progress_at": None, "expires_at": now + WINDOW,
            "finalizing_at": None, "completed_at": None, "failed_at": None,
            "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": len(lines), "completed": 0, "failed": 0},
            "metadata": metadata, "model": _model(lines),
        }
        batch = Batch(self.dir, obj, tenant, time.time())
        self.batches[batch.id] = batch
        batch.save()
        self._launch(batch)
        return batch

    def get(self, batch_id: str) -> Batch:
        """404 for an unknown batch."""
        batch = self.batches.get(batch_id)
        if batch is None:
            raise HttpError(404, "invalid_request_error", f"No such Batch object: {batch_id}",
                            param="batch_id", code="batch_not_found")
        return batch

    def cancel(self, batch_id: str) -> Batch:
        """Start cancelling a batch (its lines in flight are abandoned; the answered ones go
        to its output); 409 when it is already over."""
        batch = self.get(batch_id)
        status = batch.obj["status"]
        if status in ("cancelling", "cancelled"):
            return batch
        if status not in ACTIVE:
            raise HttpError(409, "invalid_request_error",
                            f"Cannot cancel a batch with status '{status}'.",
                            code="batch_not_cancellable")
        batch.obj.update(status="cancelling", cancelling_at=int(time.time()))
        batch.save()
        batch.halt.set()
        return batch

    def active_inputs(self) -> set[str]:
        """The input files of unfinished batches (kept past their retention)."""
        return {b.obj["input_file_id"] for b in self.batches.values()
                if b.obj["status"] in ACTIVE}

    # -- running ---------------------------------------------------------------------------

    async def _run(self, batch: Batch) -> None:
        obj = batch.obj
        try:
            lines = parse_lines(self.store.content(obj["input_file_id"]))
        except HttpError as exc:
            await self._end(batch, "failed", [{"code": exc.code or "invalid_input_file",
                                               "message": exc.message, "param": None,
                                               "line": None}])
            return
        if obj["status"] == "validating":
            obj.update(status="in_progress", in_progress_at=int(time.time()))
            batch.save()
        batch.count(len(lines))
        pending = [line for line in lines if line.number not in batch.done]
        running: set[asyncio.Task[None]] = set()
        expired = False
        try:
            for line in pending:
                if batch.halt.is_set():
                    break
                if time.time() >= obj["expires_at"]:
                    expired = True
                    break
                await self._slots.acquire()
                if batch.halt.is_set():
                    self._slots.release()
                    break
                task = asyncio.ensure_future(self._line(batch, line))
                running.add(task)
                task.add_done_callback(running.discard)
            if running:
                await asyncio.wait(set(running))
        finally:
            if running:  # shutdown: abandon them
                await cancel_and_wait(list(running))
        if obj["status"] == "cancelling":
            await self._end(batch, "cancelled")
        elif obj["errors"]:  # the store filled up
            await self._end(batch, "failed")
        elif expired:
            for line in pending:
                if line.number not in batch.done:
                    self._record(batch, line, None, _EXPIRED)
            await self._end(batch, "expired")
        else:
            await self._end(batch, "completed")

    async def _line(self, batch: Batch, line: BatchLine) -> None:
        body = msgspec.json.encode(line.body)
        self._now_in_flight += 1
        self.in_flight.set(self._now_in_flight)
        if self._now_in_flight > self._peak:
            self._peak = self._now_in_flight
            self.peak.set(self._peak)
        try:
            pause = 0.25
            while True:
                try:
                    status, answer = await call_in_process(self.app, line.url, body,
                                                           batch.tenant, batch.halt)
                except Exception as exc:  # a handler's bug: the line's answer is a 500
                    log.exception("Batch API: batch %s line %d", batch.id, line.number)
                    status, answer = 500, from_exception(exc).to_json()
                if batch.halt.is_set():
                    return  # abandoned: not answered
                if not self._retry(batch, status, answer) or time.time() >= batch.obj["expires_at"]:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(batch.halt.wait(), pause)
                if batch.halt.is_set():
                    return
                pause = min(pause * 2, 10.0)
            self._record(batch, line, (status, answer), None)
        finally:
            self._now_in_flight -= 1
            self.in_flight.set(self._now_in_flight)
            self._slots.release()

    def _retry(self, batch: Batch, status: int, answer: bytes) -> bool:
        """Whether a line's answer is worth another try: 503 and 429 always, and an unknown
        model for a resumed batch in the frontend's first ``DISCOVERY_GRACE`` seconds (its
        workers may not be discovered yet)."""
        if status in _RETRY:
            return True
        return (status == 404 and batch.resumed and time.monotonic() < self._grace_end
                and b"model_not_found" in answer)

    def _record(self, batch: Batch, line: BatchLine, answer: tuple[int, bytes] | None,
                error: dict[str, Any] | None) -> None:
        """Keep a line's output line (in memory and the progress file)."""
        if not batch.recording:
            return
        response = None
        if answer is not None:
            status, raw = answer
            try:
                body: Any = msgspec.json.decode(raw)
            except msgspec.DecodeError:
                body = raw.decode("utf-8", "replace")
            request_id = body.get("id") if isinstance(body, dict) else None
            response = {"status_code": status,
                        "request_id": request_id or f"req_{uuid.uuid4().hex}", "body": body}
            self.finished.labels("ok" if 200 <= status < 300 else "error").inc()
        out = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
               "response": response, "error": error}
        data = progress_record(line.number, out)
        try:
            self.store.reserve(len(data))
        except HttpError as exc:
            log.error("Batch API: batch %s: %s", batch.id, exc.message)
            batch.halt.set()
            batch.obj["errors"] = {"object": "list", "data": [
                {"code": exc.code, "message": exc.message, "param": None, "line": line.number}]}
            return
        batch.append(line.number, out, data)

    async def _end(self, batch: Batch, status: str,
                   errors: list[dict[str, Any]] | None = None) -> None:
        """Write the output and error files and the final status."""
        obj = batch.obj
        now = int(time.time())
        if status == "completed":
            obj.update(status="finalizing", finalizing_at=now)
            batch.save()
        progress = batch.progress
        size = progress.stat().st_size if progress.exists() else 0
        self.store.release(size)
        records = [batch.done[n] for n in sorted(batch.done)]
        ok = [r for r in records if batch.is_ok(r)]
        bad = [r for r in records if r not in ok]
        try:
            for name, rows, key in (("output", ok, "output_file_id"),
                                    ("error", bad, "error_file_id")):
                if rows:
                    content = b"".join(msgspec.json.encode(r) + b"\n" for r in rows)
                    meta = self.store.add(f"{batch.id}_{name}.jsonl", "batch_output", content)
                    obj[key] = meta["id"]
        except HttpError as exc:
            status, errors = "failed", [{"code": exc.code, "message": exc.message,
                                         "param": None, "line": None}]
        if errors:
            obj["errors"] = {"object": "list", "data": errors}
        obj.update(status=status)
        obj[{"completed": "completed_at", "failed": "failed_at", "cancelled": "cancelled_at",
             "expired": "expired_at"}[status]] = int(time.time())
        batch.save()
        progress.unlink(missing_ok=True)
        log.info("Batch API: batch %s %s (%s)", batch.id, status, obj["request_counts"])

    # -- retention -------------------------------------------------------------------------

    def expire(self) -> None:
        """Delete the files and the finished batches past ``--batch-retention``."""
        if not self.store.is_open:
            return
        now = time.time()
        for batch in list(self.batches.values()):
            obj = batch.obj
            if obj["status"] in ACTIVE:
                continue
            ended = max(obj[k] or 0 for k in ("completed_at", "failed_at", "cancelled_at",
                                              "expired_at"))
            if ended + self.config.retention <= now:
                del self.batches[batch.id]
                (self.dir / f"{batch.id}.json").unlink(missing_ok=True)
        self.store.expire(self.active_inputs())

    async def _sweep(self) -> None:
        period = max(0.5, min(60.0, self.config.retention / 4))
        while True:
            try:
                self.expire()
            except OSError as exc:
                log.warning("Batch API: retention sweep: %s", exc)
            await asyncio.sleep(period)


def _model(lines: list[BatchLine]) -> str | None:
    """The model of the lines (the first line's)."""
    model = lines[0].body.get("model") if lines else None
    return model if isinstance(model, str) else None
