"""The mocker's LoRA adapters in-process: loading checks (peft's ``adapter_config.json``, the rank
against ``--max-lora-rank``), a per-adapter KV namespace (prefix cache and the router hashes
and ``lora_name`` it publishes), ``--max-loras`` LRU eviction, and the flags. Real engine, no
mocks; fast (``speedup_ratio=1e6``) and no timing asserted."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from dynamo_zmq import errors
from dynamo_zmq.context import Context
from dynamo_zmq.llm import Capability, LLMEngineOutput, PreprocessedRequest, StopConditions
from dynamo_zmq.llm._block_hashing import block_hashes, root_hash
from dynamo_zmq.testing import validate_stream
from dynamo_zmq.tools.lora_adapter import write_adapter_config
from engines.mocker import MockerConfig, MockerEngine
from engines.mocker._blocks import BlockManager
from engines.mocker._sequence import Sequence

FAST = 1e6
MakeEngine = Callable[..., Awaitable[MockerEngine]]


@pytest.fixture
async def make_engine() -> AsyncIterator[MakeEngine]:
    made: list[MockerEngine] = []

    async def make(**overrides: Any) -> MockerEngine:
        base: dict[str, Any] = {"speedup_ratio": FAST, "enable_kv_events": False, "block_size": 16,
                                "num_gpu_blocks": 512, "host": "127.0.0.1", "vocab_size": 1000,
                                "enable_lora": True}
        engine = MockerEngine(MockerConfig(**{**base, **overrides}))
        made.append(engine)
        await engine.start(worker_id=1)
        return engine

    yield make
    for engine in made:
        await engine.cleanup()


def request(prompt: list[int], lora: str | None = None) -> PreprocessedRequest:
    return PreprocessedRequest(prompt, stop=StopConditions(max_tokens=3), lora_name=lora)


async def collect(engine: MockerEngine, req: PreprocessedRequest) -> list[LLMEngineOutput]:
    return [c async for c in validate_stream(engine.generate(req, Context()))]


async def cached(engine: MockerEngine, prompt: list[int], lora: str | None = None) -> int:
    usage = (await collect(engine, request(prompt, lora)))[-1].usage
    assert usage is not None
    return usage.cached_tokens


async def test_loading_checks_the_path_the_rank_and_the_name(
    make_engine: MakeEngine, tmp_path: Path
) -> None:
    engine = await make_engine(max_lora_rank=8)
    assert Capability.LORA in engine.capabilities()
    good = write_adapter_config(tmp_path / "good", 8, "tiny")
    await engine.load_lora("good", str(good))
    assert engine.lora_adapters() == {"good": str(good)}
    with pytest.raises(errors.InvalidArgument, match="already loaded"):
        await engine.load_lora("good", str(good))
    missing = tmp_path / "missing"
    with pytest.raises(errors.InvalidArgument, match=str(missing)):
        await engine.load_lora("missing", str(missing))
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(errors.InvalidArgument, match=r"adapter_config\.json"):
        await engine.load_lora("bare", str(bare))
    big = write_adapter_config(tmp_path / "big", 16, "tiny")
    with pytest.raises(errors.InvalidArgument, match=r"LoRA rank 16 .* max_lora_rank 8"):
        await engine.load_lora("big", str(big))
    assert engine.lora_adapters() == {"good": str(good)}  # nothing half-loaded
    with pytest.raises(errors.NotFound):
        await engine.unload_lora("big")
    await engine.unload_lora("good")
    assert engine.lora_adapters() == {}
    with pytest.raises(errors.NotFound, match="good"):
        await collect(engine, request([1, 2, 3], "good"))


async def test_without_enable_lora_there_are_no_adapters(
    make_engine: MakeEngine, tmp_path: Path
) -> None:
    engine = await make_engine(enable_lora=False)
    assert Capability.LORA not in engine.capabilities()
    assert "max_loras" not in engine.engine_config.extra
    with pytest.raises(errors.Unsupported, match="--enable-lora"):
        await engine.load_lora("a", str(write_adapter_config(tmp_path / "a", 8, "tiny")))


async def test_each_adapter_caches_its_own_blocks(make_engine: MakeEngine, tmp_path: Path) -> None:
    engine = await make_engine(max_loras=2)
    for name in ("a", "b"):
        await engine.load_lora(name, str(write_adapter_config(tmp_path / name, 8, "tiny")))
    prompt = list(range(1, 66))  # four full blocks and one token
    assert await cached(engine, prompt) == 0
    assert await cached(engine, prompt) == 64
    assert await cached(engine, prompt, "a") == 0  # the base model's blocks do not serve "a"
    assert await cached(engine, prompt, "a") == 64
    assert await cached(engine, prompt, "b") == 0  # nor "a"'s "b"
    assert await cached(engine, prompt, "b") == 64
    assert await cached(engine, prompt) == 64  # the base model's are still there


def test_an_adapters_blocks_carry_its_name_and_the_routers_adapter_hashes() -> None:
    tokens = list(range(100, 148))
    seq = Sequence(tokens, block_size=16, vocab_size=1000, seed=0, max_tokens=1,
                   lora_name="a")
    base = Sequence(tokens, block_size=16, vocab_size=1000, seed=0, max_tokens=1)
    assert seq.own_hashes(3) == block_hashes(tokens, 16, root_hash("a"))
    assert base.own_hashes(3) == block_hashes(tokens, 16)
    assert not set(seq.block_hashes(3)) & set(base.block_hashes(3))
    blocks = BlockManager(8, 16)
    ids = blocks.allocate(3)
    assert ids is not None
    blocks.cache_blocks(ids, seq.block_hashes(3), None, tokens, seq.own_hashes(3), "a")
    (stored,) = blocks.take_events()
    assert stored.lora_name == "a" and stored.own_hashes == seq.own_hashes(3)


async def test_max_loras_evicts_the_least_recently_used_idle_adapter(
    make_engine: MakeEngine, tmp_path: Path
) -> None:
    engine = await make_engine(max_loras=1, lora_load_delay=5.0)
    # Advertised, for the KV router's residency prediction (router/_lora_residency.py).
    assert engine.engine_config.extra["max_loras"] == 1
    for name in ("a", "b"):
        await engine.load_lora(name, str(write_adapter_config(tmp_path / name, 8, "tiny")))
    (slots,) = engine.resident
    await collect(engine, request([1, 2, 3], "a"))
    await collect(engine, request([1, 2, 3], "a"))
    assert (slots.resident(), slots.loads, slots.evictions) == (["a"], 1, 0)
    await collect(engine, request([1, 2, 3], "b"))
    assert (slots.resident(), slots.loads, slots.evictions) == (["b"], 2, 1)
    # Both at once with one slot: the second waits for the first to end, then both finish.
    both = await asyncio.gather(collect(engine, request([4, 5, 6], "a")),
                                collect(engine, request([4, 5, 6], "b")))
    assert all(chunks[-1].finish_reason == "length" for chunks in both)
    assert slots.loads == 4 and len(slots.resident()) == 1


async def test_a_stopped_request_waiting_for_an_adapter_is_cancelled(
    make_engine: MakeEngine, tmp_path: Path
) -> None:
    engine = await make_engine(max_loras=1, lora_load_delay=1e9)  # a load never ends
    await engine.load_lora("a", str(write_adapter_config(tmp_path / "a", 8, "tiny")))
    ctx = Context()
    stream = validate_stream(engine.generate(request([1, 2, 3], "a"), ctx))
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.01)
    assert not first.done()
    ctx.stop()
    chunk = await first
    assert chunk.finish_reason == "cancelled"


async def test_lora_modules_load_at_start_and_a_bad_one_fails_the_start(tmp_path: Path) -> None:
    good = write_adapter_config(tmp_path / "good", 8, "tiny")
    engine = MockerEngine(MockerConfig(enable_lora=True, enable_kv_events=False,
                                       lora_modules=(("good", str(good)),)))
    try:
        await engine.start(worker_id=1)
        assert engine.lora_adapters() == {"good": str(good)}
    finally:
        await engine.cleanup()
    bad = MockerEngine(MockerConfig(enable_lora=True, enable_kv_events=False,
                                    lora_modules=(("bad", str(tmp_path / "nope")),)))
    with pytest.raises(errors.InvalidArgument, match="nope"):
        await bad.start(worker_id=1)
    await bad.cleanup()
    with pytest.raises(ValueError, match="--enable-lora"):
        MockerConfig(lora_modules=(("good", str(good)),))


def test_the_lora_flags_and_their_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    MockerEngine.add_args(parser)
    cfg = MockerEngine.from_namespace(parser.parse_args([])).config
    assert (cfg.enable_lora, cfg.max_loras, cfg.max_lora_rank, cfg.lora_modules,
            cfg.lora_load_delay) == (False, 1, 16, (), 0.0)
    args = parser.parse_args(["--enable-lora", "--max-loras", "3", "--max-lora-rank", "64",
                              "--lora-modules", "a=/x/a", "b=/x/b", "--lora-load-delay", "0.5"])
    cfg = MockerEngine.from_namespace(args).config
    assert (cfg.enable_lora, cfg.max_loras, cfg.max_lora_rank, cfg.lora_modules,
            cfg.lora_load_delay) == (True, 3, 64, (("a", "/x/a"), ("b", "/x/b")), 0.5)
    for name, value in (("DYN_ENABLE_LORA", "1"), ("DYN_MAX_LORAS", "2"),
                        ("DYN_MAX_LORA_RANK", "32"), ("DYN_LORA_MODULES", "c=/x/c d=/x/d"),
                        ("DYN_LORA_LOAD_DELAY", "2")):
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    MockerEngine.add_args(parser)
    cfg = MockerEngine.from_namespace(parser.parse_args([])).config
    assert (cfg.enable_lora, cfg.max_loras, cfg.max_lora_rank, cfg.lora_modules,
            cfg.lora_load_delay) == (True, 2, 32, (("c", "/x/c"), ("d", "/x/d")), 2.0)
    with pytest.raises(errors.InvalidArgument, match="NAME=PATH"):
        MockerEngine.from_namespace(parser.parse_args(["--lora-modules", "nopath"]))
