"""The mocker engine end to end: stop rules, determinism, batching, chunked prefill, preemption,
prefix caching, data-parallel ranks, cancellation, flags and lifecycle. Real engine, no mocks;
every engine runs at ``speedup_ratio=1e6`` and no test asserts timing."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import engines.mocker
from dynamo_zmq import errors
from dynamo_zmq.context import Context
from dynamo_zmq.llm import (
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    RoutingHints,
    SamplingOptions,
    StopConditions,
)
from dynamo_zmq.testing import run_conformance, validate_stream
from engines.mocker import MockerConfig, MockerEngine
from engines.mocker._timing import decode_ms, prefill_ms, step_seconds

FAST = 1e6
MakeEngine = Callable[..., Awaitable[MockerEngine]]


@pytest.fixture
async def make_engine() -> AsyncIterator[MakeEngine]:
    """Start mocker engines (fast, no KV events unless asked); all are cleaned up."""
    made: list[MockerEngine] = []

    async def make(**overrides: Any) -> MockerEngine:
        base: dict[str, Any] = {"speedup_ratio": FAST, "enable_kv_events": False, "block_size": 16,
                                "num_gpu_blocks": 512, "host": "127.0.0.1"}
        engine = MockerEngine(MockerConfig(**{**base, **overrides}))
        made.append(engine)
        await engine.start(worker_id=1)
        return engine

    yield make
    for engine in made:
        await engine.cleanup()


def request(prompt: list[int] | int = 32, *, seed: int | None = None, rank: int | None = None,
            eos: list[int] | None = None, **stop: Any) -> PreprocessedRequest:
    tokens = [i % 3 for i in range(prompt)] if isinstance(prompt, int) else prompt
    return PreprocessedRequest(
        tokens, sampling=SamplingOptions(seed=seed), stop=StopConditions(**stop),
        routing=RoutingHints(dp_rank=rank), eos_token_ids=eos or [],
    )


async def collect(
    engine: MockerEngine, req: PreprocessedRequest, ctx: Context | None = None
) -> list[LLMEngineOutput]:
    """Every chunk of one stream, checked by the project's stream-contract validator."""
    return [c async for c in validate_stream(engine.generate(req, ctx or Context()))]


def tokens_of(chunks: list[LLMEngineOutput]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def assert_all_free(engine: MockerEngine) -> None:
    for rank in engine.ranks:
        blocks = rank.blocks
        assert blocks.num_active == 0
        assert blocks.num_free + blocks.num_cached == blocks.num_blocks
        assert not rank.waiting and not rank.running


# -- stop rules -----------------------------------------------------------------------------


async def test_max_tokens_gives_length_with_exactly_that_many_tokens(
    make_engine: MakeEngine,
) -> None:
    engine = await make_engine(eos_token_ids=(7,), vocab_size=50)
    chunks = await collect(engine, request(40, max_tokens=37, ignore_eos=True))
    assert [c.finish_reason for c in chunks[:-1]] == [None] * 36
    assert all(len(c.token_ids) == 1 for c in chunks)  # one token per step, terminal included
    last = chunks[-1]
    assert last.finish_reason == FinishReason.LENGTH
    assert len(tokens_of(chunks)) == 37
    assert (
        last.usage is not None
        and (last.usage.prompt_tokens, last.usage.completion_tokens) == (40, 37)
    )
    assert all(0 <= t < 50 for t in tokens_of(chunks))
    assert_all_free(engine)


async def test_default_max_tokens_is_the_rest_of_the_context(make_engine: MakeEngine) -> None:
    engine = await make_engine(context_length=100, vocab_size=1000)
    chunks = await collect(engine, request(90))
    assert chunks[-1].finish_reason == FinishReason.LENGTH
    assert len(tokens_of(chunks)) == 10


async def test_stop_token_ends_with_stop_and_includes_the_token(make_engine: MakeEngine) -> None:
    engine = await make_engine(vocab_size=4)
    chunks = await collect(engine, request(20, seed=3, max_tokens=500, stop_token_ids=[2]))
    toks = tokens_of(chunks)
    assert chunks[-1].finish_reason == FinishReason.STOP
    assert chunks[-1].token_ids == [2]
    assert 2 not in toks[:-1]


async def test_eos_from_request_and_config_stop_unless_ignored(make_engine: MakeEngine) -> None:
    engine = await make_engine(vocab_size=4, eos_token_ids=(3,))
    by_config = await collect(engine, request(20, seed=1, max_tokens=500))
    assert by_config[-1].finish_reason == FinishReason.STOP and by_config[-1].token_ids == [3]
    by_request = await collect(engine, request(20, seed=1, max_tokens=500, eos=[1]))
    assert by_request[-1].finish_reason == FinishReason.STOP
    assert by_request[-1].token_ids[-1] in (1, 3)
    ignored = await collect(engine, request(20, seed=1, max_tokens=60, eos=[1], ignore_eos=True))
    assert ignored[-1].finish_reason == FinishReason.LENGTH
    assert {1, 3} <= set(tokens_of(ignored))  # they came up and did not stop it


async def test_min_tokens_defers_eos_and_stop_tokens(make_engine: MakeEngine) -> None:
    engine = await make_engine(vocab_size=3, eos_token_ids=(0,))
    chunks = await collect(
        engine, request(20, seed=5, max_tokens=500, min_tokens=25, stop_token_ids=[1])
    )
    toks = tokens_of(chunks)
    assert len(toks) >= 25
    assert chunks[-1].finish_reason == FinishReason.STOP and toks[-1] in (0, 1)
    assert {0, 1} & set(toks[:24])  # stop candidates came up early and were ignored
    assert not {0, 1} & set(toks[24:-1])


# -- determinism ----------------------------------------------------------------------------


async def test_tokens_are_deterministic_per_seed_and_prompt(make_engine: MakeEngine) -> None:
    engine = await make_engine(vocab_size=1000)
    first = tokens_of(await collect(engine, request(30, seed=11, max_tokens=40)))
    again = tokens_of(await collect(engine, request(30, seed=11, max_tokens=40)))
    other_seed = tokens_of(await collect(engine, request(30, seed=12, max_tokens=40)))
    other_prompt = tokens_of(await collect(engine, request(31, seed=11, max_tokens=40)))
    assert first == again
    assert first != other_seed and first != other_prompt
    base_a = await make_engine(vocab_size=1000, seed=1)
    base_b = await make_engine(vocab_size=1000, seed=2)
    a = tokens_of(await collect(base_a, request(30, max_tokens=40)))
    b = tokens_of(await collect(base_b, request(30, max_tokens=40)))
    assert a != b
    assert a == tokens_of(await collect(base_a, request(30, max_tokens=40)))
    # An explicit request seed wins over the engine's seed.
    assert tokens_of(await collect(base_a, request(30, seed=11, max_tokens=40))) == first


async def test_a_migrated_request_continues_as_it_would_have(make_engine: MakeEngine) -> None:
    """A continuation (prompt + the tokens generated so far, ``resume``) gets exactly the
    tokens the uninterrupted request would have had next, on another engine, with usage
    counted from its extended prompt (the worker corrects it); min_tokens left as the rest."""
    from dynamo_zmq.llm._migration import continuation

    one, two = await make_engine(vocab_size=1000), await make_engine(vocab_size=1000)
    original = request(30, seed=5, max_tokens=40, min_tokens=10, eos=[7])
    whole = await collect(one, original)
    tokens = tokens_of(whole)
    for cut in (1, 9, 25):
        resumed = continuation(original, tokens[:cut])
        assert resumed is not None
        rest = await collect(two, resumed)
        assert tokens_of(rest) == tokens[cut:]
        assert rest[-1].finish_reason == whole[-1].finish_reason
        assert rest[-1].usage is not None
        assert (rest[-1].usage.prompt_tokens, rest[-1].usage.completion_tokens) == (
            30 + cut, len(tokens) - cut
        )


# -- batching -------------------------------------------------------------------------------


async def test_fifty_concurrent_requests_each_end_once(make_engine: MakeEngine) -> None:
    engine = await make_engine(vocab_size=1000, max_num_seqs=16, max_num_batched_tokens=256)
    reqs = [request(10 + i, seed=i, max_tokens=5 + i % 7, ignore_eos=True) for i in range(50)]
    results = await asyncio.gather(*(collect(engine, r) for r in reqs))
    for i, chunks in enumerate(results):
        assert sum(c.is_terminal for c in chunks) == 1 and chunks[-1].is_terminal
        assert chunks[-1].finish_reason == FinishReason.LENGTH
        assert len(tokens_of(chunks)) == 5 + i % 7
    alone = tokens_of(await collect(engine, reqs[13]))
    assert alone == tokens_of(results[13])  # batching does not change the tokens
    assert_all_free(engine)


async def test_long_prompt_is_prefilled_in_chunks(make_engine: MakeEngine) -> None:
    engine = await make_engine(vocab_size=1000, max_num_batched_tokens=64, block_size=16)
    chunks = await collect(engine, request(1000, max_tokens=3, ignore_eos=True))
    assert chunks[-1].finish_reason == FinishReason.LENGTH and len(tokens_of(chunks)) == 3
    # 1000 prompt tokens at 64 per step: 16 prefill steps, then 2 decode steps.
    assert engine.ranks[0].num_steps == 16 + 2
    assert_all_free(engine)


async def test_preemption_recomputes_and_keeps_outputs_exact(make_engine: MakeEngine) -> None:
    roomy = await make_engine(vocab_size=1000)
    tight = await make_engine(
        vocab_size=1000, block_size=4, num_gpu_blocks=12, enable_prefix_caching=False
    )
    reqs = [request(list(range(100 + 10 * i, 110 + 10 * i)), seed=i, max_tokens=30, ignore_eos=True)
            for i in range(6)]
    expected = [tokens_of(await collect(roomy, r)) for r in reqs]
    results = await asyncio.gather(*(collect(tight, r) for r in reqs))
    assert tight.ranks[0].num_preemptions > 0
    for chunks, want in zip(results, expected, strict=True):
        assert chunks[-1].finish_reason == FinishReason.LENGTH
        assert tokens_of(chunks) == want
    assert_all_free(tight)


async def test_a_sequence_larger_than_the_cache_ends_with_length(make_engine: MakeEngine) -> None:
    engine = await make_engine(vocab_size=1000, block_size=4, num_gpu_blocks=4)
    chunks = await collect(engine, request(10, max_tokens=100, ignore_eos=True))
    assert chunks[-1].finish_reason == FinishReason.LENGTH
    assert len(tokens_of(chunks)) == 16 - 10 + 1  # the last sampled token needs no KV slot
    too_long = await collect(engine, request(17, max_tokens=5))
    assert too_long[-1].finish_reason == FinishReason.ERROR and "KV blocks" in (
        too_long[-1].error or ""
    )
    assert_all_free(engine)


# -- prefix caching -------------------------------------------------------------------------


async def test_shared_prefix_is_served_from_the_cache(make_engine: MakeEngine) -> None:
    engine = await make_engine(vocab_size=1000, block_size=16)
    prefix = list(range(1, 201))
    first = await collect(engine, request([*prefix, 900, 901], max_tokens=4))
    second = await collect(engine, request([*prefix, 902, 903, 904], max_tokens=4))
    assert first[-1].usage is not None and first[-1].usage.cached_tokens == 0
    assert second[-1].usage is not None and second[-1].usage.cached_tokens == 192  # 12 full blocks
    same = await collect(engine, request([*prefix, 900, 901], max_tokens=4))
    assert same[-1].usage is not None and same[-1].usage.cached_tokens == 192
    assert_all_free(engine)


async def test_without_prefix_caching_nothing_is_cached(make_engine: MakeEngine) -> None:
    engine = await make_engine(vocab_size=1000, block_size=16, enable_prefix_caching=False)
    prefix = list(range(1, 201))
    await collect(engine, request(prefix, max_tokens=4))
    again = await collect(engine, request(prefix, max_tokens=4))
    assert again[-1].usage is not None and again[-1].usage.cached_tokens == 0
    assert engine.ranks[0].blocks.num_cached == 0


# -- data-parallel ranks --------------------------------------------------------------------


async def test_dp_rank_hint_is_honoured_and_checked(make_engine: MakeEngine) -> None:
    engine = await make_engine(vocab_size=1000, data_parallel_size=3)
    assert engine.engine_config is not None and engine.engine_config.data_parallel_size == 3
    await collect(engine, request(40, rank=2, max_tokens=3))
    assert [r.num_steps > 0 for r in engine.ranks] == [False, False, True]
    bad = await collect(engine, request(40, rank=3, max_tokens=3))
    assert (
        len(bad) == 1
        and bad[0].finish_reason == FinishReason.ERROR
        and "dp_rank 3" in (bad[0].error or "")
    )


async def test_without_a_hint_the_least_loaded_rank_is_chosen(make_engine: MakeEngine) -> None:
    engine = await make_engine(vocab_size=1000, data_parallel_size=2, context_length=200_000)
    ctx = Context()
    busy = validate_stream(
        engine.generate(request(40, rank=0, max_tokens=100_000, ignore_eos=True), ctx)
    )
    await busy.__anext__()  # rank 0 now runs a long request
    assert [r.load for r in engine.ranks] == [1, 0]
    await collect(engine, request(40, max_tokens=3))
    assert engine.ranks[1].num_steps > 0
    ctx.stop()
    rest = [c async for c in busy]
    assert rest[-1].finish_reason == FinishReason.CANCELLED


# -- cancellation ---------------------------------------------------------------------------


async def _started_stream(
    engine: MockerEngine, ctx: Context, n: int = 3
) -> tuple[AsyncIterator[LLMEngineOutput], list[LLMEngineOutput]]:
    """A long request's stream, after its first ``n`` chunks."""
    stream = validate_stream(
        engine.generate(request(100, max_tokens=100_000, ignore_eos=True), ctx)
    )
    got = [await stream.__anext__() for _ in range(n)]
    return stream, got


async def test_ctx_stop_ends_with_cancelled_and_frees_blocks(make_engine: MakeEngine) -> None:
    engine = await make_engine(vocab_size=1000, context_length=200_000)
    ctx = Context()
    stream, got = await _started_stream(engine, ctx)
    assert engine.ranks[0].blocks.num_active > 0
    ctx.stop()
    rest = [c async for c in stream]
    assert rest[-1].finish_reason == FinishReason.CANCELLED
    usage = rest[-1].usage
    assert usage is not None and usage.completion_tokens == len(tokens_of(got + rest))
    assert_all_free(engine)


async def test_kill_and_abort_cancel_at_once(make_engine: MakeEngine) -> None:
    engine = await make_engine(vocab_size=1000, context_length=200_000)
    ctx = Context()
    stream, _ = await _started_stream(engine, ctx)
    await engine.abort(ctx)
    assert_all_free(engine)  # freed before the stream is even read again
    rest = [c async for c in stream]
    assert [c.finish_reason for c in rest][-1] == FinishReason.CANCELLED
    ctx2 = Context()
    stream2, _ = await _started_stream(engine, ctx2)
    ctx2.kill()
    assert_all_free(engine)
    rest2 = [c async for c in stream2]
    assert rest2[-1].finish_reason == FinishReason.CANCELLED


async def test_a_stopped_context_is_cancelled_before_it_starts(make_engine: MakeEngine) -> None:
    engine = await make_engine()
    ctx = Context()
    ctx.stop()
    chunks = await collect(engine, request(10, max_tokens=5), ctx)
    assert [c.finish_reason for c in chunks] == [FinishReason.CANCELLED]


async def test_closing_or_cancelling_the_consumer_frees_the_sequence(
    make_engine: MakeEngine,
) -> None:
    engine = await make_engine(vocab_size=1000, context_length=200_000)
    stream = engine.generate(request(100, max_tokens=100_000, ignore_eos=True), Context())
    await stream.__anext__()
    await stream.aclose()  # type: ignore[attr-defined]
    assert_all_free(engine)

    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(
            request(100, max_tokens=100_000, ignore_eos=True), Context()
        ):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    await asyncio.wait({task})
    assert task.cancelled()
    assert_all_free(engine)


async def test_drain_waits_for_in_flight_work(make_engine: MakeEngine) -> None:
    engine = await make_engine(vocab_size=1000)
    tasks = [
        asyncio.create_task(collect(engine, request(50 + i, max_tokens=20, ignore_eos=True)))
        for i in range(5)
    ]
    await asyncio.sleep(0)
    await engine.drain()
    assert all(r.load == 0 for r in engine.ranks)
    for task in tasks:
        assert (await task)[-1].finish_reason == FinishReason.LENGTH


# -- errors and lifecycle -------------------------------------------------------------------


async def test_bad_requests_get_one_error_chunk(make_engine: MakeEngine) -> None:
    engine = await make_engine(context_length=64, vocab_size=100)
    cases = {
        "context length": request(64),
        "empty": request([]),
        "max_tokens": request(10, max_tokens=0),
        "[0, 100)": request([5, 100]),
    }
    for needle, req in cases.items():
        chunks = await collect(engine, req)
        assert len(chunks) == 1 and chunks[0].finish_reason == FinishReason.ERROR
        assert needle in (chunks[0].error or ""), chunks[0].error
    assert len(tokens_of(await collect(engine, request(63)))) == 1


async def test_cleanup_is_idempotent_safe_before_start_and_ends_open_streams() -> None:
    never = MockerEngine()
    await never.cleanup()
    await never.cleanup()
    chunks = await collect(never, request(5))
    assert chunks[-1].finish_reason == FinishReason.ERROR

    engine = MockerEngine(
        MockerConfig(speedup_ratio=FAST, host="127.0.0.1", context_length=200_000)
    )
    await engine.start(1)
    stream, _ = await _started_stream(engine, Context())
    await engine.cleanup()
    rest = [c async for c in stream]
    assert rest[-1].finish_reason == FinishReason.ERROR
    await engine.cleanup()
    with pytest.raises(RuntimeError):
        await engine.start(1)


async def test_a_crashed_rank_fails_its_streams_with_engine_shutdown() -> None:
    """A rank whose scheduler task dies (here: its KV-event publishing fails) is a crash: its
    streams, and requests after it, raise EngineShutdown; the engine reports itself dead."""
    from tests.support.engines import CrashingMockerTestEngine

    engine = CrashingMockerTestEngine(
        MockerConfig(speedup_ratio=FAST, host="127.0.0.1", block_size=4), crash_at=3
    )
    await engine.start(1)
    try:
        assert engine.dead_reason() is None
        got: list[LLMEngineOutput] = []
        with pytest.raises(errors.EngineShutdown, match="mocker rank 0 crashed"):
            async for chunk in engine.generate(request(30, max_tokens=100), Context()):
                got.append(chunk)
        assert got and not any(c.is_terminal for c in got)
        assert "mocker rank 0 crashed" in (engine.dead_reason() or "")
        with pytest.raises(errors.EngineShutdown):
            await collect(engine, request(5))
    finally:
        await engine.cleanup()


async def test_passes_the_engine_conformance_kit() -> None:
    report = await run_conformance(
        lambda: MockerEngine(MockerConfig(speedup_ratio=FAST, host="127.0.0.1"))
    )
    assert report.config is not None and report.config.model_name == "mocker"


# -- flags and model directory --------------------------------------------------------------


def test_flags_have_dynamos_names_and_defaults() -> None:
    parser = argparse.ArgumentParser()
    MockerEngine.add_args(parser)
    args = parser.parse_args([])
    assert (args.block_size, args.num_gpu_blocks_override, args.max_num_seqs,
            args.max_num_batched_tokens, args.speedup_ratio, args.data_parallel_size,
            args.enable_prefix_caching, args.mocker_seed, args.kv_events_port,
            args.kv_replay_port, args.no_kv_events) == (
        64, 16384, 256, 8192, 1.0, 1, True, 0, 0, 0, False)
    args = parser.parse_args(["--no-enable-prefix-caching", "--speedup-ratio", "5",
                              "--no-kv-events", "--data-parallel-size", "2", "--mocker-seed", "9"])
    cfg = MockerEngine.from_namespace(args).config
    assert (cfg.enable_prefix_caching, cfg.speedup_ratio, cfg.enable_kv_events,
            cfg.data_parallel_size, cfg.seed) == (False, 5.0, False, 2, 9)


def _model_dir(root: Path) -> Path:
    model = root / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"vocab_size": 1234, "max_position_embeddings": 2048, "eos_token_id": 2}))
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    return model


async def test_from_namespace_reads_the_model_directory(tmp_path: Path) -> None:
    model = _model_dir(tmp_path)
    engine = MockerEngine.from_namespace(argparse.Namespace(model_path=str(model)))
    assert isinstance(engine, MockerEngine)
    cfg = engine.config
    assert (cfg.model_name, cfg.vocab_size, cfg.context_length, cfg.eos_token_ids) == (
        "tiny-llama", 1234, 2048, (2, 7))
    try:
        ec = await engine.start(worker_id=7)
        assert (ec.model_name, ec.served_model_name, ec.context_length, ec.kv_block_size,
                ec.total_kv_blocks, ec.data_parallel_size, ec.data_parallel_start_rank) == (
            "tiny-llama", "tiny-llama", 2048, 64, 16384, 1, 0)
        assert ec.kv_events_endpoint is not None and ec.kv_events_endpoint.startswith("tcp://127.0.0.1:")
        assert ec.kv_replay_endpoint is not None and ec.kv_replay_endpoint != ec.kv_events_endpoint
    finally:
        await engine.cleanup()

    named = MockerEngine.from_namespace(argparse.Namespace(
        model_path=str(model), model_name="served", host="127.0.0.1",
        no_kv_events=True, speedup_ratio=FAST,
    ))
    try:
        ec = await named.start(worker_id=7)
        assert (
            ec.model_name == "served"
            and ec.kv_events_endpoint is None
            and ec.kv_replay_endpoint is None
        )
    finally:
        await named.cleanup()


def test_the_workers_parser_takes_the_mocker_flags(tmp_path: Path) -> None:
    from dynamo_zmq.worker import build_parser

    model = _model_dir(tmp_path)
    parser = build_parser(MockerEngine)
    args = parser.parse_args(["--model-path", str(model), "--mdns-interfaces", "127.0.0.1",
                              "--block-size", "16", "--no-enable-prefix-caching"])
    cfg = MockerEngine.from_namespace(args).config
    assert (cfg.block_size, cfg.enable_prefix_caching, cfg.vocab_size) == (16, False, 1234)
    # No --host: the KV sockets bind and advertise where the worker's request plane does.
    assert (cfg.bind_host, cfg.advertised_host()) == ("127.0.0.1", "127.0.0.1")
    wildcard = MockerEngine.from_namespace(
        parser.parse_args(["--model-path", str(model), "--host", "0.0.0.0"])
    )
    assert wildcard.config.bind_host == "*"
    assert wildcard.config.advertised_host() not in ("0.0.0.0", "*", "")


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        MockerConfig(block_size=0)
    with pytest.raises(ValueError):
        MockerConfig(speedup_ratio=0)
    assert dataclasses.replace(MockerConfig(), host="0.0.0.0").bind_host == "*"


def test_step_time_model_is_dynamos() -> None:
    assert prefill_ms(0) == 0.0
    assert prefill_ms(1000) == pytest.approx(4.209989e-7 * 1e6 + 1.518344e-2 * 1000 + 16.50142)
    assert decode_ms(0.0) == pytest.approx(5.74)
    assert decode_ms(0.5) == pytest.approx(-25.74 * 0.25 + 54.01 * 0.5 + 5.74)
    assert step_seconds(0, 0, 0.3, 1.0) == 0.0
    assert step_seconds(100, 3, 0.0, 10.0) == pytest.approx((prefill_ms(100) + 5.74) / 10_000)


def test_public_names() -> None:
    assert engines.mocker.__all__ == sorted(engines.mocker.__all__)
    assert MockerEngine.name == "mocker"


async def test_stats_report_kv_usage_for_the_worker_metrics():
    engine = MockerEngine(
        MockerConfig(speedup_ratio=FAST, host="127.0.0.1", num_gpu_blocks=64, block_size=16)
    )
    await engine.start(1)
    try:
        stats = engine.stats()
        assert stats["kv_total_blocks"] == 64 and stats["kv_active_blocks"] == 0
        from dynamo_zmq.context import Context
        from dynamo_zmq.llm import PreprocessedRequest, StopConditions

        seen = []
        req = PreprocessedRequest(token_ids=list(range(1, 100)), stop=StopConditions(max_tokens=50))
        async for _ in engine.generate(req, Context()):
            seen.append(engine.stats()["kv_active_blocks"])
        assert max(seen) >= 99 // 16  # the prompt's blocks were in use while generating
        assert engine.stats()["kv_active_blocks"] == 0
    finally:
        await engine.cleanup()
