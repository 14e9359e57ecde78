"""``SubStream``: one sub-request's outputs (``FanOut``), a batch at a time, across the
workers that serve it: a stream that fails goes on from the one its migration recovers."""

from __future__ import annotations

from .. import errors
from ..llm import LLMEngineOutput, Migration, OutputStream
from . import errors as http_errors
from ._subrequests import SubRequest
from .errors import HttpError

__all__ = ["SubStream"]

_NO_FINISH = "the worker ended the stream without a finish"


class SubStream:
    """One sub-request's outputs, a batch at a time, from whichever worker serves it now: a
    stream that fails goes on from the stream its migration recovers, if it can."""

    __slots__ = ("migration", "record", "stream", "sub")

    def __init__(self, sub: SubRequest, stream: OutputStream, migration: Migration | None) -> None:
        self.sub, self.stream, self.migration = sub, stream, migration
        if migration is not None:
            migration.arm(stream)  # a stream that stalls is lost, and migrates
        #: What each output's token ids are added to (the migration's record of them).
        self.record = migration.generated.extend if migration is not None else None

    def served_by(self) -> str:
        rank = self.sub.pre.routing.dp_rank
        return f"{self.stream.instance_id:x}" + ("" if rank is None else f"/{rank}")

    async def next(self) -> list[LLMEngineOutput] | HttpError | None:
        """The next outputs; or the error that ends the sub-request; or None when its stream
        was cancelled (the client went away, or the deadline passed)."""
        while True:
            try:
                batch = await self.stream.next_batch()
            except errors.Cancelled:
                return None
            except errors.DynamoError as exc:
                recovered = await self._recover(exc)
                if recovered is None or isinstance(recovered, HttpError):
                    return recovered
                self.stream = recovered
                continue
            if not batch:
                return http_errors.engine_error(_NO_FINISH)
            record = self.record
            if record is not None:
                migration = self.migration
                assert migration is not None
                for out in batch:
                    if migration.link is None and out.token_ids:
                        # what a migration's trace links to: the first worker's span
                        migration.link = out.worker_trace_link
                    record(out.token_ids)
            return batch

    async def _recover(self, exc: errors.DynamoError) -> OutputStream | HttpError | None:
        if self.migration is not None:
            try:
                return await self.migration.recover(self.stream, exc)
            except errors.Cancelled:
                return None
            except errors.DynamoError as final:
                exc = final
        return http_errors.from_dynamo(exc)
