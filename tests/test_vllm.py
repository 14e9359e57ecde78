"""The vLLM engine adapter (engines/vllm) against real vLLM on the tiny model: conformance, greedy
output equal to vLLM's own, cancellation, data-parallel ranks, KV events, and worker processes
with the default (worker-side) and native (vLLM-side) processing.

Runs only where vLLM is installed (the ``vllm`` extra); skipped otherwise, except in CI
(``CI=true``), where a missing vLLM fails the module.
"""

from __future__ import annotations

import asyncio
import time

import pytest

import tests.support.needs_vllm  # noqa: F401  (skips this module without vLLM; fails it in CI)

# isort: split

import msgspec
import pytest_asyncio
import zmq
import zmq.asyncio
from tokenizers import Tokenizer

from dynamo_zmq import errors
from dynamo_zmq.context import Context
from dynamo_zmq.llm import (
    OutputOptions,
    PreprocessedRequest,
    RoutingHints,
    SamplingOptions,
    StopConditions,
    postprocess,
)
from dynamo_zmq.testing import run_conformance, validate_stream
from engines.vllm import VllmEngine, VllmOptions
from tests.conftest import runtime_factory
from tests.support.http_calls import get_text
from tests.support.metrics import sample
from tests.support.vllm_stack import (
    ENGINE_ARGS,
    MAX_MODEL_LEN,
    VLLM_ENV,
    WORKER_FLAGS,
    WORKER_START,
    use_vllm_env,
)

# vLLM on this CPU (a small KV cache, multiprocessing off for the uni executor), for the
# engines this module runs in the test process.
use_vllm_env()

BLOCK = 32

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]


def engine_args(model) -> dict:
    return {"model": str(model), **ENGINE_ARGS}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model):
    """One started engine for the module (loading costs ~15 s)."""
    eng = VllmEngine(engine_args(tiny_model))
    await eng.start(1)
    yield eng
    await eng.cleanup()


@pytest_asyncio.fixture(loop_scope="module")
async def make_runtime():
    """Runtimes closed on the module's event loop, where this module's tests run them."""
    async with runtime_factory() as make:
        yield make


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


def greedy(tokens, max_tokens=24, **stop) -> PreprocessedRequest:
    return PreprocessedRequest(
        token_ids=list(tokens), sampling=SamplingOptions(temperature=0.0),
        stop=StopConditions(max_tokens=max_tokens, **stop),
    )


async def collect(stream) -> list:
    return [chunk async for chunk in validate_stream(stream)]


async def direct(engine: VllmEngine, tokens, max_tokens=24) -> tuple[list[int], str, str]:
    """(token ids, text, finish reason) from vLLM itself, bypassing the adapter."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    final = None
    async for out in engine.llm.generate(TokensPrompt(prompt_token_ids=list(tokens)), params,
                                         f"direct-{time.monotonic_ns()}"):
        final = out
    comp = final.outputs[0]
    return list(comp.token_ids), comp.text, str(comp.finish_reason)


def prompts(tokenizer: Tokenizer) -> list[list[int]]:
    texts = [
        "Once upon a time there was", "The worker engine said", "water and light over the land"
    ]
    return [tokenizer.encode(t).ids for t in texts] + [[1, 5, 9, 200, 300, 17]]


# -- the engine contract ---------------------------------------------------------------------


async def test_conformance(tiny_model):
    """Five fresh engines (start, stream, concurrent, cancel, cleanup twice) plus cleanup
    before start; about a minute on two cores."""
    opts = VllmOptions(kv_events=False, shutdown_timeout=1.0)
    report = await run_conformance(lambda: VllmEngine(engine_args(tiny_model), opts), timeout=180)
    assert report.passed == ["start", "stream", "concurrent", "cancel", "cleanup_twice",
                             "cleanup_before_start"]
    assert report.config is not None and report.config.kv_events_endpoint is None


async def test_engine_config_and_stats(engine, tiny_model):
    cfg = engine.engine_config
    assert cfg.model_name == str(tiny_model) and cfg.served_model_name == tiny_model.name
    assert cfg.context_length == MAX_MODEL_LEN and cfg.kv_block_size == BLOCK
    assert cfg.total_kv_blocks > 0 and cfg.max_num_seqs > 0 and cfg.max_num_batched_tokens > 0
    assert cfg.data_parallel_size == 1
    assert cfg.kv_events_endpoint.startswith("tcp://127.0.0.1:")
    assert cfg.kv_replay_endpoint.startswith("tcp://127.0.0.1:")
    assert cfg.extra["engine"] == "vllm" and cfg.extra["native_processing"] is False
    await collect(engine.generate(greedy([1, 2, 3], 2), Context()))
    stats = engine.stats()
    assert stats["kv_total_blocks"] == cfg.total_kv_blocks and "num_running" in stats


async def test_health_canary_request(engine):
    """The worker's canary: token [1], one token, ignore_eos."""
    req = PreprocessedRequest(token_ids=[1], stop=StopConditions(max_tokens=1, ignore_eos=True))
    chunks = await collect(engine.generate(req, Context()))
    assert chunks[-1].finish_reason == "length" and sum(len(c.token_ids) for c in chunks) == 1


async def test_greedy_equals_vllm_direct(engine, tokenizer):
    """The worker's code path (engine + post-processing) gives vLLM's own ids and text."""
    for tokens in prompts(tokenizer):
        ids, text, reason = await direct(engine, tokens)
        req = greedy(tokens)
        chunks = await collect(postprocess(engine.generate(req, Context()), req, tokenizer))
        assert [t for c in chunks for t in c.token_ids] == ids
        assert "".join(c.text or "" for c in chunks) == text
        assert chunks[-1].finish_reason == reason
        assert chunks[-1].usage.prompt_tokens == len(tokens)
        assert chunks[-1].usage.completion_tokens == len(ids)


async def test_max_tokens_and_length(engine):
    chunks = await collect(engine.generate(greedy([1, 7, 8, 9], 3, ignore_eos=True), Context()))
    assert sum(len(c.token_ids) for c in chunks) == 3
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 3
    assert [c.is_terminal for c in chunks].count(True) == 1


async def test_stop_strings_by_the_worker_and_natively(engine, tokenizer):
    tokens = prompts(tokenizer)[0]
    _, text, _ = await direct(engine, tokens, 24)
    stop = text.strip()[2:5]
    assert stop and stop in text, text
    expect = text[: text.find(stop)]
    # Fast path: vLLM gets no stop strings; the worker's post-processing cuts the text.
    req = greedy(tokens, 24, stop=[stop])
    chunks = await collect(postprocess(engine.generate(req, Context()), req, tokenizer, None))
    assert "".join(c.text or "" for c in chunks) == expect and chunks[-1].finish_reason == "stop"
    # Native: vLLM detokenizes and stops; post-processing passes its text through.
    native = msgspec.structs.replace(req, output=OutputOptions(detokenize=True))
    chunks = await collect(postprocess(engine.generate(native, Context()), native, None, None))
    assert "".join(c.text or "" for c in chunks) == expect and chunks[-1].finish_reason == "stop"


async def test_logprobs_texts_of_the_worker_equal_vllms_native_ones(engine, tokenizer):
    """With logprobs, the fast path (the worker's token texts) and native processing (vLLM's
    own texts) give the same tokens, values, alternatives and texts."""

    def flat(chunks) -> tuple[list, list, list, list]:
        ids, values, tops, texts = [], [], [], []
        for c in chunks:
            ids += c.token_ids
            values += c.log_probs or []
            tops += c.top_logprobs or []
            texts += c.logprob_texts or []
        return ids, values, tops, texts

    req = msgspec.structs.replace(greedy(prompts(tokenizer)[3], 12),
                                  output=OutputOptions(logprobs=3))
    fast = flat(await collect(postprocess(engine.generate(req, Context()), req, tokenizer)))
    native = msgspec.structs.replace(req, output=OutputOptions(logprobs=3, detokenize=True))
    own = flat(await collect(postprocess(engine.generate(native, Context()), native, None)))
    ids, values, tops, texts = fast
    assert ids == own[0] and len(values) == len(tops) == len(texts) == len(ids) > 0
    assert values == pytest.approx(own[1], abs=1e-5) and texts == own[3]
    assert [[t for t, _ in top] for top in tops] == [[t for t, _ in top] for top in own[2]]
    for token, value, top in zip(ids, values, tops, strict=True):
        assert len(top) == 3 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert (token, value) == top[0]  # greedy: the sampled token is the most likely


async def test_vllm_names_the_stop_token_it_stopped_on(engine, tokenizer):
    """vLLM's ``stop_reason`` travels in the terminal chunk; the worker's post-processing keeps
    it for a stop token the request named."""
    tokens = prompts(tokenizer)[0]
    ids, _, _ = await direct(engine, tokens, 24)
    stop_token = ids[2]
    req = greedy(tokens, 24, stop_token_ids=[stop_token])
    chunks = await collect(engine.generate(req, Context()))
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stop_reason == stop_token
    processed = await collect(postprocess(engine.generate(req, Context()), req, tokenizer))
    assert (processed[-1].finish_reason, processed[-1].stop_reason) == ("stop", stop_token)


async def test_cancel_mid_stream_aborts_in_vllm(engine):
    req = PreprocessedRequest(
        token_ids=[1, 2, 3, 4], stop=StopConditions(max_tokens=400, ignore_eos=True)
    )
    ctx = Context("cancel-me")
    chunks = []
    async for chunk in validate_stream(engine.generate(req, ctx)):
        chunks.append(chunk)
        if len(chunks) == 3:
            ctx.stop()
    assert chunks[-1].finish_reason == "cancelled"
    assert sum(len(c.token_ids) for c in chunks) < 400
    assert engine.llm.get_num_unfinished_requests() == 0
    assert not engine.live_requests


async def test_closing_the_stream_aborts_in_vllm(engine):
    req = PreprocessedRequest(
        token_ids=[1, 2, 3], stop=StopConditions(max_tokens=400, ignore_eos=True)
    )
    stream = engine.generate(req, Context())
    await stream.__anext__()
    assert engine.llm.get_num_unfinished_requests() == 1
    await stream.aclose()
    assert engine.llm.get_num_unfinished_requests() == 0


async def test_load_is_what_vllms_scheduler_reports(engine):
    """load(): rank 0's KV-cache usage as blocks of its cache and its queues, from vLLM's
    scheduler stats (recorded at every engine step, so each token brings a fresh one)."""
    total = engine.engine_config.total_kv_blocks
    req = PreprocessedRequest(
        token_ids=list(range(1, 100)), stop=StopConditions(max_tokens=400, ignore_eos=True)
    )
    stream = engine.generate(req, Context())
    seen = []
    try:
        async for _chunk in stream:
            seen = engine.load()
            if seen and seen[0].num_running == 1 and seen[0].active_blocks >= 1:
                break
    finally:
        await stream.aclose()
    (rank,) = seen
    assert rank.dp_rank == 0 and rank.total_blocks == total and 1 <= rank.active_blocks <= total
    assert rank.num_running == 1 and rank.num_waiting == 0
    assert engine.stats()["kv_total_blocks"] == total


async def test_dp_rank_hints(engine):
    ok = msgspec.structs.replace(
        greedy([1, 2], 2, ignore_eos=True), routing=RoutingHints(dp_rank=0)
    )
    assert (await collect(engine.generate(ok, Context())))[-1].finish_reason == "length"
    bad = msgspec.structs.replace(ok, routing=RoutingHints(dp_rank=1))
    (chunk,) = await collect(engine.generate(bad, Context()))
    assert chunk.finish_reason == "error" and "dp_rank 1 out of range" in chunk.error


async def test_what_vllm_rejects_is_invalid_argument(engine):
    bad = PreprocessedRequest(token_ids=[1], sampling=SamplingOptions(temperature=-1.0))
    with pytest.raises(errors.InvalidArgument, match="temperature"):
        await collect(engine.generate(bad, Context()))
    too_long = PreprocessedRequest(token_ids=[5] * (MAX_MODEL_LEN + 10))
    with pytest.raises(errors.InvalidArgument, match="maximum context length"):
        await collect(engine.generate(too_long, Context()))
    assert engine.llm.get_num_unfinished_requests() == 0


async def test_without_lora_and_priority_scheduling(engine):
    """vLLM's defaults (no --enable-lora, fcfs): neither capability; a request's priority is
    not passed (fcfs ignores it), an adapter is NotFound, loading one Unsupported."""
    from dynamo_zmq.llm import Capability

    assert not {Capability.LORA, Capability.PRIORITY} & engine.capabilities()
    chunks = await collect(engine.generate(
        PreprocessedRequest(token_ids=[1, 5, 9], stop=StopConditions(max_tokens=3), priority=5),
        Context()))
    assert chunks[-1].finish_reason == "length"
    with pytest.raises(errors.NotFound, match="start it with --enable-lora"):
        await collect(engine.generate(PreprocessedRequest(token_ids=[1], lora_name="a"),
                                      Context()))
    with pytest.raises(errors.Unsupported, match="--enable-lora"):
        await engine.load_lora("a", "/nowhere")
    with pytest.raises(errors.NotFound):
        await engine.unload_lora("a")
    assert engine.lora_adapters() == {}


# -- KV events ---------------------------------------------------------------------------------


async def test_kv_events_block_stored_and_indexed(engine):
    # The relay publishes vLLM's stores as own-hash deltas (the default --kv-event-form).
    from dynamo_zmq.llm import OwnStored
    from router._own_events import decode_own_batch
    from router.hashing import block_hashes
    from router.indexer import KvIndexer

    cfg = engine.engine_config
    prompt = [(7 * i + 11) % 500 + 4 for i in range(7 * BLOCK + 5)]  # 7 full blocks
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(cfg.kv_events_endpoint)
    replay = ctx.socket(zmq.DEALER)
    replay.connect(cfg.kv_replay_endpoint)
    try:
        await asyncio.sleep(0.5)  # the SUB joins before the request runs; replay covers a miss
        await collect(engine.generate(greedy(prompt, 2), Context()))
        batches: dict[int, bytes] = {}
        deadline = time.monotonic() + 10
        index = KvIndexer(BLOCK)
        while time.monotonic() < deadline:
            if await sub.poll(200):
                topic, seq, payload = await sub.recv_multipart()
                assert topic == cfg.extra["kv_events_topic"].encode()
                batches[int.from_bytes(seq, "big")] = payload
            elif batches or time.monotonic() > deadline - 8:
                break
        # Replay from seq 0 fills whatever the SUB missed (slow joiner), then ends with seq -1.
        await replay.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            _, topic, seq, payload = await asyncio.wait_for(replay.recv_multipart(), 5)
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            batches.setdefault(int.from_bytes(seq, "big"), payload)
        stored: list[int] = []
        for seq in sorted(batches):
            batch, _ = decode_own_batch(batches[seq])
            index.apply_batch(42, batch)
            stored += [h for e in batch.events if isinstance(e, OwnStored) for h in e.own_hashes]
        assert cfg.kv_hash_scheme is not None and cfg.kv_hash_scheme.form == "deltas"
        assert set(block_hashes(prompt, BLOCK)) <= set(stored)  # its 7 full blocks, hashed as
        assert index.find_matches(prompt) == {(42, 0): 7}  # the router hashes them
    finally:
        sub.close(0)
        replay.close(0)
        ctx.term()


# -- worker processes --------------------------------------------------------------------------


def vllm_worker(spawn, namespace, model, *extra):
    proc = spawn("-m", "dynamo_zmq.worker", "--engine", "vllm", "--model-path", str(model),
                 "--model-name", "tiny", "--namespace", namespace, "--host", "127.0.0.1",
                 "--metrics-port", "0", *WORKER_FLAGS, *extra, env=VLLM_ENV, ready=False)
    return proc.wait_ready(WORKER_START)


def metrics_port(proc) -> int:
    return int(next(line.split()[-1] for line in proc.logs().splitlines()
                    if "metrics and health on port" in line))


def worker_request(tokens, max_tokens=24, native=False, **stop) -> dict:
    req = {"token_ids": list(tokens), "sampling": {"temperature": 0.0},
           "stop": {"max_tokens": max_tokens, **stop}}
    if native:
        req["output"] = {"detokenize": True}
    return req


async def run_requests(client, reqs) -> list[tuple[list[int], str, str]]:
    out = []
    for req in reqs:
        chunks = [r.data() async for r in await client.generate(req)]
        out.append(([t for c in chunks for t in c.get("token_ids", [])],
                    "".join(c.get("text") or "" for c in chunks), chunks[-1]["finish_reason"]))
    return out


async def test_workers_default_and_native_match_vllm(
    engine, tokenizer, spawn, namespace, make_runtime, tiny_model
):
    """A default worker and a --native-processing worker (one at a time, to bound memory) give
    vLLM's own greedy ids and text; stop strings, max_tokens and cancellation through both."""
    token_lists = prompts(tokenizer)
    expect = [await direct(engine, t) for t in token_lists]
    stop = expect[0][1].strip()[2:5]
    cut = expect[0][1][: expect[0][1].find(stop)]
    results = {}
    for mode, extra in (("default", ()), ("native", ("--native-processing",))):
        proc = vllm_worker(spawn, f"{namespace}{mode}", tiny_model, *extra)
        native = mode == "native"
        client = await make_runtime(static=(proc.address,)).endpoint(
            f"{namespace}{mode}.backend.generate").client()
        await client.wait_for_instances(timeout=15)
        got = await run_requests(client, [worker_request(t, native=native) for t in token_lists])
        assert got == expect, mode
        (ids, text, reason), = await run_requests(
            client, [worker_request(token_lists[0], native=native, stop=[stop])]
        )
        assert text == cut and reason == "stop", mode
        (ids, _, reason), = await run_requests(client, [worker_request([1, 4, 4], 5, native=native,
                                                                        ignore_eos=True)])
        assert len(ids) == 5 and reason == "length", mode
        ctx = Context()
        chunks = []
        async for r in await client.generate(
            worker_request([1, 2, 3], 400, ignore_eos=True), context=ctx
        ):
            chunks.append(r.data())
            if len(chunks) == 2:
                ctx.stop()
        assert chunks[-1]["finish_reason"] == "cancelled", mode
        port = metrics_port(proc)
        deadline = time.monotonic() + 10
        while True:
            body = await asyncio.to_thread(get_text, f"http://127.0.0.1:{port}/metrics")
            if (sample(body, "dynamo_component_cancellation_total", model="tiny") == 1
                    and sample(body, "dynamo_component_inflight_requests", model="tiny") == 0):
                break
            assert time.monotonic() < deadline, body[-2000:]
            await asyncio.sleep(0.2)
        results[mode] = got
        proc.stop()
    assert results["default"] == results["native"]


async def test_native_processing_flags_map_onto_vllms_own(tiny_model):
    """The native-processing document's flag and its vllm-named alias (and the older
    ``--native-processing``) turn on vLLM's own processing; another engine's alias is refused."""
    base = ["--model-path", str(tiny_model)]
    for flag in ("--native-framework-processing", "--vllm-processing", "--native-processing"):
        engine, _ = VllmEngine.from_args([*base, flag])
        assert engine.options.native_processing is True, flag
    assert VllmEngine.from_args(base)[0].options.native_processing is False
    with pytest.raises(errors.InvalidArgument, match="--trtllm-processing asks the trtllm"):
        VllmEngine.from_args([*base, "--trtllm-processing"])


def _engine_core(worker_pid: int):
    """vLLM's engine-core process under a worker."""
    import psutil

    children = psutil.Process(worker_pid).children(recursive=True)
    cores = [c for c in children
             if "EngineCore" in c.name() or "EngineCore" in " ".join(c.cmdline())]
    assert len(cores) == 1, [(c.name(), c.cmdline()) for c in children]
    return cores[0]


async def test_a_dead_engine_core_fails_requests_with_engine_shutdown(
    spawn, namespace, make_runtime, tiny_model
):
    """vLLM's engine core dying (EngineDeadError) mid-request reaches the caller as
    EngineShutdown (retryable); a request after it gets EngineShutdown while the worker is
    still listed, and CannotConnect (retryable too) once its failing health canary has taken
    it out of routing (issue 33: a canary also runs when the engine stalls)."""
    proc = vllm_worker(spawn, namespace, tiny_model)
    client = await make_runtime(static=(proc.address,)).endpoint(
        f"{namespace}.backend.generate").client()
    await client.wait_for_instances(timeout=15)
    streams = [await client.generate(worker_request([1, 2, 3], MAX_MODEL_LEN - 8,
                                                    ignore_eos=True)) for _ in range(2)]
    for stream in streams:
        await stream.__anext__()
    _engine_core(proc.pid).kill()
    for stream in streams:
        with pytest.raises(errors.EngineShutdown, match="engine core"):
            async for _ in stream:
                pass
    with pytest.raises((errors.EngineShutdown, errors.CannotConnect)):
        async for _ in await client.generate(worker_request([4, 5], 4)):
            pass


async def test_vllm_worker_serves_vllms_metrics_and_clears_its_cache(
    spawn, namespace, make_runtime, tiny_model
):
    """One worker's /metrics holds Dynamo's component metrics and vLLM's own (``vllm:*``), and
    its clear_kv_blocks endpoint resets vLLM's prefix cache."""
    proc = vllm_worker(spawn, namespace, tiny_model)
    runtime = make_runtime(static=(proc.address,))
    client = await runtime.endpoint(f"{namespace}.backend.generate").client()
    await client.wait_for_instances(timeout=15)
    (ids, _, reason), = await run_requests(client, [worker_request([1, 4, 4] * 30, 4,
                                                                    ignore_eos=True)])
    assert len(ids) == 4 and reason == "length"
    port = metrics_port(proc)
    deadline = time.monotonic() + 15
    while True:
        body = await asyncio.to_thread(get_text, f"http://127.0.0.1:{port}/metrics")
        if (sample(body, "vllm:request_success_total") or 0) >= 1:
            break
        assert time.monotonic() < deadline, body[-3000:]
        await asyncio.sleep(0.2)
    assert sample(body, "dynamo_component_requests_total", model="tiny") == 1
    assert "python_gc_objects_collected_total" not in body  # only vLLM's families are added
    clear = await runtime.endpoint(f"{namespace}.backend.clear_kv_blocks").client()
    await clear.wait_for_instances(timeout=15)
    answers = [r.data() async for r in await clear.direct({}, proc.instance_id)]
    assert answers == [{"status": "success", "message": "KV cache cleared"}]
