"""The tracing helpers in-process: with tracing off (the default) the worker's engine stream is
returned untouched (no per-chunk layer) and every helper is a no-op; the stream statistics
``engine.generate`` records are computed from chunk times as the document defines them."""

from __future__ import annotations

import asyncio

from dynamo_zmq import tracing
from dynamo_zmq.context import Context
from dynamo_zmq.llm import LLMEngineOutput, PreprocessedRequest
from dynamo_zmq.worker._engine_span import trace_engine
from dynamo_zmq.worker._stream_stats import StreamStats


async def _chunks():
    yield LLMEngineOutput([1], finish_reason="length")


def test_off_the_engine_stream_is_untouched_and_helpers_are_no_ops() -> None:
    assert not tracing.state.active  # nothing in this process set it up
    stream = _chunks()
    assert trace_engine(stream, PreprocessedRequest([1, 2]), Context(), "agg", True) == (
        stream, None)
    asyncio.run(stream.aclose())
    with tracing.span("route", worker_id="1") as sp, tracing.engine_span("mine") as own:
        assert sp is None and own is None
    assert tracing.outgoing() is None and tracing.current_ids() is None
    coro = _chunks().aclose()
    assert tracing.handled(coro, {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"},
                           "ns.c.e", "r") is coro
    asyncio.run(coro)


def test_stream_stats_from_chunk_times() -> None:
    stats = StreamStats()
    stats.start = 100.0
    stats.times = [100.5, 100.51, 100.53, 100.56, 101.56]  # gaps 10, 20, 30, 1000 ms
    stats.output_tokens = 7
    attrs = stats.attributes()
    assert attrs["output_tokens"] == 7
    assert abs(attrs["ttft_ms"] - 500) < 1e-6
    assert abs(attrs["avg_itl_ms"] - 265) < 1e-6
    assert abs(attrs["itl_p50_ms"] - 30) < 1e-6
    assert abs(attrs["itl_p99_ms"] - 1000) < 1e-6 and abs(attrs["itl_max_ms"] - 1000) < 1e-6
    assert StreamStats().attributes() == {"output_tokens": 0}


def test_traceparent_round_trip_and_malformed_values() -> None:
    sc = tracing.parse_traceparent("00-" + "ab" * 16 + "-" + "cd" * 8 + "-01")
    assert sc is not None and sc.trace_id == int("ab" * 16, 16) and sc.span_id == int("cd" * 8, 16)
    assert tracing.traceparent(sc) == "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    for bad in (None, "", "00-xyz-1-01", "00-" + "0" * 32 + "-" + "1" * 16 + "-01", "garbage"):
        assert tracing.parse_traceparent(bad) is None
    assert tracing.extract({"traceparent": "nonsense"}) is None and tracing.extract(None) is None
