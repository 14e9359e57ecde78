"""OpenTelemetry tracing and JSON-lines logs through real processes (issue 19 items 1 and 2): a
frontend and mocker workers export to a local OTLP/HTTP receiver (``tests/support``), driven by
the real ``openai`` client. One trace runs HTTP -> route -> ``handle_payload`` ->
``engine.generate`` with the document's attributes; a migrated request's second
``engine.generate`` links to the first; a disaggregated decode links to its prefill; logs carry
the trace id; with export off nothing is exported."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest

from tests.support import waiting
from tests.support.disagg import wait_pools
from tests.support.migration import MESSAGES, PARAMS, client_for, serving_worker
from tests.support.mocker_fleet import Fleet, mocker_fleet, start_frontend, start_mocker
from tests.support.otlp_receiver import OtlpReceiver, Span
from tests.support.procs import Proc

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
ENGINE_ATTRS = {"model", "input_tokens", "disagg_role", "ttft_ms", "output_tokens",
                "finish_reason", "cancelled", "avg_itl_ms", "itl_p50_ms", "itl_p99_ms",
                "itl_max_ms"}


@pytest.fixture
def receiver():
    with OtlpReceiver() as rx:
        yield rx


def mocker(spawn, namespace: str, model: Path, env: dict[str, str], *extra: str) -> Proc:
    return start_mocker(spawn, namespace, model, *extra, speedup="100", env=env).wait_ready()


async def traced(spawn, namespace: str, model: Path, env: dict[str, str], *extra: str,
                 mode: str | None = None) -> Fleet:
    """A mocker worker (``extra`` flags) and a frontend, both with ``env``; the worker listed."""
    return await mocker_fleet(spawn, namespace, model, 1, mode=mode, speedup="100", env=env,
                              worker_args=extra)


def trace_of(header: str) -> str:
    version, trace_id, span_id, flags = header.split("-")
    assert version == "00" and len(span_id) == 16 and int(flags, 16) & 1  # sampled
    return trace_id


def named(spans: list[Span], name: str, trace_id: str) -> list[Span]:
    return [s for s in spans if s.name == name and s.trace_id == trace_id]


def stderr_lines(proc: Proc) -> list[str]:
    """Every whole line the process wrote to stderr so far (``logs()`` is only the tail; a
    running process may be in the middle of its last line)."""
    text = Path(proc.log.name).read_text()
    return [ln for ln in text[:text.rfind("\n") + 1].splitlines() if ln.strip()]


def json_lines(proc: Proc, lines: list[str] | None = None) -> list[dict]:
    """The JSON records among ``lines`` (default: the process's stderr lines now)."""
    return [json.loads(line) for line in (stderr_lines(proc) if lines is None else lines)
            if line.startswith("{")]


@pytest.mark.parametrize("mode", ["round-robin", "kv"])
async def test_one_trace_from_http_to_engine(namespace, spawn, tiny_model, receiver, mode):
    """A client's ``traceparent`` is honoured and returned (same trace id): under it the
    frontend's ``http.request``, ``preprocess`` and ``route`` (with the chosen worker, and the
    overlap in kv mode), the worker's ``handle_payload`` under ``route``, ``engine.generate``
    under that with every attribute filled, and the engine's own span (``engine_span``) under
    ``engine.generate``. Each process's JSON-lines log records of the request carry its trace
    id."""
    env = {**receiver.env(), "DYN_LOGGING_JSONL": "1", "DYN_LOG": "debug"}
    f = await traced(spawn, namespace, tiny_model, env, "--engine",
                     "tests.support.engines:SpanningMocker", mode=mode)
    (worker,), front, url = f.workers, f.front, f.url
    async with client_for(url) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="tiny", messages=MESSAGES, max_tokens=12, extra_body={"ignore_eos": True},
            extra_headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
        )
        assert raw.parse().usage.completion_tokens == 12
    assert trace_of(raw.headers["traceparent"]) == CLIENT_TRACE

    spans = await asyncio.to_thread(
        receiver.wait_for, lambda ss: named(ss, "handle_payload", CLIENT_TRACE)
        and named(ss, "http.request", CLIENT_TRACE))  # each ends last on its process
    (http,) = named(spans, "http.request", CLIENT_TRACE)
    assert http.service == "dynamo-frontend" and http.parent_id == CLIENT_SPAN
    assert http.attributes["http.response.status_code"] == 200
    assert raw.headers["traceparent"].split("-")[2] == http.span_id
    (pre,) = named(spans, "preprocess", CLIENT_TRACE)
    assert pre.parent_id == http.span_id
    (route,) = named(spans, "route", CLIENT_TRACE)
    assert route.parent_id == http.span_id
    assert route.attributes["worker_id"] == f"{worker.instance_id:x}"
    assert ("overlap_blocks" in route.attributes) == (mode == "kv"), route.attributes
    (handle,) = named(spans, "handle_payload", CLIENT_TRACE)
    assert handle.service == "dynamo-worker" and handle.parent_id == route.span_id
    (engine,) = named(spans, "engine.generate", CLIENT_TRACE)
    assert engine.service == "dynamo-worker" and engine.parent_id == handle.span_id
    attrs = engine.attributes
    assert ENGINE_ATTRS <= attrs.keys(), attrs
    assert attrs["model"] == "tiny" and attrs["disagg_role"] == "agg"
    assert attrs["input_tokens"] > 3 and attrs["output_tokens"] == 12
    assert attrs["finish_reason"] == "length" and attrs["cancelled"] is False
    assert attrs["ttft_ms"] > 0 and 0 <= attrs["itl_p50_ms"] <= attrs["itl_max_ms"]
    assert "error_kind" not in attrs and not engine.status_error
    (own,) = [s for s in spans
              if s.name.startswith("engine.first_output_") and s.trace_id == CLIENT_TRACE]
    assert own.parent_id == engine.span_id and own.trace_id == CLIENT_TRACE
    assert own.attributes["blocks"] == 8 and own.attributes["first_tokens"] >= 1

    # Every stderr line is a JSON record; the request's carry its trace id.
    for proc in (worker, front):
        lines = stderr_lines(proc)  # read once: a running process goes on logging
        records = json_lines(proc, lines)
        assert records and len(records) == len(lines), [ln for ln in lines
                                                        if not ln.startswith("{")][:5]
        assert {"time", "level", "target", "message"} <= records[0].keys()
        mine = [r for r in records if r.get("trace_id") == CLIENT_TRACE]
        assert mine and all(len(r["span_id"]) == 16 for r in mine), proc.logs()[-2000:]
    ended = [r for r in json_lines(worker) if "engine.generate of request" in r["message"]]
    assert any(r["trace_id"] == CLIENT_TRACE and r["span_id"] == engine.span_id for r in ended)


async def test_export_off_exports_nothing(namespace, spawn, tiny_model, receiver):
    """The endpoint configured but ``OTEL_EXPORT_ENABLED`` unset: nothing reaches the receiver,
    and without JSON-lines logs no trace context is made at all (no ``traceparent`` back)."""
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint,
           "OTEL_BSP_SCHEDULE_DELAY": "100"}
    f = await traced(spawn, namespace, tiny_model, env)
    (worker,), front, url = f.workers, f.front, f.url
    async with client_for(url) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="tiny", messages=MESSAGES, max_tokens=4,
            extra_headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
        )
        assert raw.parse().choices[0].message.content
    assert "traceparent" not in raw.headers
    for proc in (front, worker):
        proc.signal(signal.SIGTERM)
        assert proc.wait() == 0
    assert receiver.posts == 0 and receiver.spans == []


async def test_json_logs_carry_the_trace_id_with_export_off(namespace, spawn, tiny_model,
                                                            receiver):
    """``DYN_LOGGING_JSONL=1`` alone: spans are made locally (nothing exported) so the logs of a
    request carry the trace id the response's ``traceparent`` names."""
    env = {"DYN_LOGGING_JSONL": "1", "DYN_LOG": "debug",
           "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint}
    f = await traced(spawn, namespace, tiny_model, env)
    (worker,), url = f.workers, f.url
    async with client_for(url) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="tiny", messages=MESSAGES, max_tokens=4)
        raw.parse()
    trace_id = trace_of(raw.headers["traceparent"])
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while not any(r.get("trace_id") == trace_id for r in json_lines(worker)):
        assert loop.time() < deadline, worker.logs()[-2000:]
        await asyncio.sleep(0.05)
    assert receiver.posts == 0


async def test_a_migrated_requests_engine_span_links_to_the_first(namespace, spawn, tiny_model,
                                                                   receiver):
    """A worker whose engine ends the stream with ``EngineShutdown`` after some tokens: its
    ``engine.generate`` fails with ``error_kind``, and the continuation's ``engine.generate``
    on the other worker, in the same trace, links to it (``migration_link``)."""
    env = receiver.env()
    f = await traced(spawn, namespace, tiny_model, env)
    (whole,), url = f.workers, f.url
    ending = mocker(spawn, namespace, tiny_model, env, "--engine",
                    "tests.support.engines:ShuttingDownMocker", "--shutdown-after", "10")
    await waiting.serving(f.front, [whole, ending])
    async with client_for(url) as client:
        for _ in range(4):  # round-robin: until one starts on the worker that ends it
            raw = await client.chat.completions.with_raw_response.create(
                model="tiny", messages=MESSAGES, **PARAMS)
            if serving_worker([ending, whole], raw.headers["x-dynamo-worker"]) is ending:
                break
        assert serving_worker([ending, whole], raw.headers["x-dynamo-worker"]) is ending
        assert raw.parse().usage.completion_tokens == PARAMS["max_tokens"]
    trace_id = trace_of(raw.headers["traceparent"])
    spans = await asyncio.to_thread(  # (a parent ends after its child: maybe a later export)
        receiver.wait_for, lambda ss: len(named(ss, "engine.generate", trace_id)) == 2
        and len(named(ss, "handle_payload", trace_id)) == 2)
    first, second = sorted(named(spans, "engine.generate", trace_id),
                           key=lambda s: bool(s.links))
    assert first.status_error and first.attributes["error_kind"] == "EngineShutdown"
    assert not second.status_error and second.attributes["finish_reason"] == "length"
    assert [(t, s) for t, s, _ in second.links] == [(trace_id, first.span_id)]
    assert second.links[0][2]["link.kind"] == "migration_link"
    assert second.attributes["migration_span_id"] == first.span_id
    handles = {s.span_id: s for s in named(spans, "handle_payload", trace_id)}
    assert first.parent_id in handles and second.parent_id in handles


async def test_a_disaggregated_decode_links_to_its_prefill(namespace, spawn, tiny_model,
                                                           receiver):
    """Prefill and decode mocker workers behind a frontend (``--disagg-mode always``): the
    decode worker's ``engine.generate`` links to the prefill worker's (``worker_trace_link``),
    both in the request's trace."""
    env = receiver.env()
    for role in ("prefill", "decode"):
        mocker(spawn, namespace, tiny_model, env, "--disaggregation-mode", role)
    url = start_frontend(spawn, namespace, "--disagg-mode", "always", mode=None,
                         env=env).wait_ready().address
    await wait_pools(url, prefill=1)
    async with client_for(url) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "Hello there"}], max_tokens=5,
            extra_body={"ignore_eos": True})
        assert raw.parse().usage.completion_tokens == 5
    trace_id = trace_of(raw.headers["traceparent"])
    spans = await asyncio.to_thread(
        receiver.wait_for, lambda ss: len(named(ss, "engine.generate", trace_id)) == 2)
    by_role = {s.attributes["disagg_role"]: s for s in named(spans, "engine.generate", trace_id)}
    prefill, decode = by_role["prefill"], by_role["decode"]
    assert prefill.attributes["output_tokens"] == 1
    assert decode.attributes["output_tokens"] == 5
    assert [(t, s) for t, s, _ in decode.links] == [(trace_id, prefill.span_id)]
    assert decode.links[0][2]["link.kind"] == "worker_trace_link"
    assert not prefill.links


async def test_the_router_service_logs_json_lines(namespace, spawn):
    """``python -m router`` with ``DYN_LOGGING_JSONL=1``: every stderr line is a JSON record."""
    router = spawn("-m", "router", "--namespace", namespace, "--host", "127.0.0.1",
                   env={"DYN_LOGGING_JSONL": "1"})
    router.signal(signal.SIGTERM)
    assert router.wait() == 0
    lines = stderr_lines(router)
    records = [json.loads(line) for line in lines]
    assert records and all(r["level"] and r["target"] and "message" in r for r in records)
    assert any("tracing on as 'dynamo-router'" in r["message"] for r in records), lines
