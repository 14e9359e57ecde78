"""JSON-lines logs (``DYN_LOGGING_JSONL=1``, Dynamo's convention): one JSON object per record,
with ``time``, ``level``, ``target`` (the logger), ``message`` and, whenever a span is current
(a request being handled), its ``trace_id`` and ``span_id``."""

from __future__ import annotations

import datetime
import json
import logging

from opentelemetry import trace

__all__ = ["JsonLinesFormatter"]


class JsonLinesFormatter(logging.Formatter):
    """Formats a record as one line of JSON."""

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
        obj: dict[str, object] = {
            "time": when.isoformat(timespec="microseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "target": record.name,
            "message": record.getMessage(),
        }
        sc = trace.get_current_span().get_span_context()
        if sc.is_valid:
            obj["trace_id"] = f"{sc.trace_id:032x}"
            obj["span_id"] = f"{sc.span_id:016x}"
        if record.exc_info:
            obj["exception"] = self.formatException(record.exc_info)
        return json.dumps(obj, ensure_ascii=False, default=str)
