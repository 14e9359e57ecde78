"""The Batch API's state on disk read back (``_batch_state.py``), and its duration flag, on
their own: a progress file whose last line a crash tore is read up to that line and truncated
there (the torn line's request is sent again); a finished batch's progress is not read. The
restart itself, through real processes: tests/test_batch_api.py."""

from __future__ import annotations

import json

import pytest

from dynamo_zmq.frontend._batch_files import parse_duration
from dynamo_zmq.frontend._batch_state import load_batches


def _batch(status: str) -> dict:
    return {"id": f"batch_{status}", "status": status,
            "request_counts": {"total": 3, "completed": 0, "failed": 0}}


def _out(custom_id: str, status: int) -> dict:
    return {"id": f"batch_req_{custom_id}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": "r", "body": {}}, "error": None}


def test_a_torn_progress_line_is_dropped_and_truncated(tmp_path):
    for status in ("in_progress", "completed"):
        saved = {"batch": _batch(status), "tenant": None, "created": 1.0}
        (tmp_path / f"batch_{status}.json").write_text(json.dumps(saved))
        good = b"".join(json.dumps({"line": n, "out": _out(c, s)}).encode() + b"\n"
                        for n, c, s in ((1, "a", 200), (3, "c", 400)))
        (tmp_path / f"batch_{status}.progress.jsonl").write_bytes(good + b'{"line": 2, "ou')
    (tmp_path / "junk.json").write_text("not json")
    batches = {b.id: b for b in load_batches(tmp_path)}
    assert set(batches) == {"batch_in_progress", "batch_completed"}
    running = batches["batch_in_progress"]
    assert sorted(running.done) == [1, 3]
    assert running.obj["request_counts"] == {"total": 3, "completed": 1, "failed": 1}
    assert running.progress.read_bytes() == good  # the torn line is gone
    assert batches["batch_completed"].done == {}


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("1.5", 1.5), ("45s", 45),
                                               ("90m", 5400), ("12h", 43200), ("30d", 2592000)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "-5", "5w", "h", "1e3", "nan"])
def test_bad_durations(text):
    with pytest.raises(ValueError):
        parse_duration(text)
