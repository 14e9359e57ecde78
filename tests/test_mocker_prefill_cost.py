"""The mocker's ``--prefill-ms-per-token``: prefill costs a flat time per uncached token, so a
cached prefix shortens the time to the first token. Real engine; the one timed check is a lower
bound the simulated sleep guarantees plus an ordering with a wide margin."""

from __future__ import annotations

import argparse
import time

import pytest

from dynamo_zmq.context import Context
from dynamo_zmq.llm import PreprocessedRequest, StopConditions
from engines.mocker import MockerConfig, MockerEngine
from engines.mocker._timing import prefill_ms, step_seconds


def test_flat_cost_replaces_dynamos_fit_only_when_asked() -> None:
    assert prefill_ms(1000, 0.0) == prefill_ms(1000)  # the default: Dynamo's fit
    assert prefill_ms(1000, 0.05) == pytest.approx(50.0)  # no fixed part
    assert prefill_ms(0, 0.05) == 0.0
    assert step_seconds(100, 1, 0.0, 2.0, 0.5) == pytest.approx((50.0 + 5.74) / 2000)
    with pytest.raises(ValueError):
        MockerConfig(prefill_ms_per_token=-1.0)


def test_flag_reaches_the_config() -> None:
    parser = argparse.ArgumentParser()
    MockerEngine.add_args(parser)
    assert MockerEngine.from_namespace(parser.parse_args([])).config.prefill_ms_per_token == 0.0
    args = parser.parse_args(["--prefill-ms-per-token", "0.04"])
    assert MockerEngine.from_namespace(args).config.prefill_ms_per_token == 0.04


async def _ttft(engine: MockerEngine, prompt: list[int]) -> float:
    req = PreprocessedRequest(prompt, stop=StopConditions(max_tokens=1))
    t0 = time.monotonic()
    async for chunk in engine.generate(req, Context()):
        if chunk.token_ids:
            return time.monotonic() - t0
    raise AssertionError("no token")


async def test_a_cached_prefix_shows_in_the_time_to_first_token() -> None:
    engine = MockerEngine(MockerConfig(
        block_size=16, num_gpu_blocks=64, enable_kv_events=False, host="127.0.0.1",
        prefill_ms_per_token=20.0,
    ))
    await engine.start(worker_id=1)
    try:
        prompt = list(range(1, 65))  # 4 blocks: 64 tokens x 20 ms = 1.28 s uncached
        cold = await _ttft(engine, prompt)
        warm = await _ttft(engine, prompt)  # 63 tokens cached, the last one computed: 20 ms
        assert cold >= 1.2
        assert warm < cold / 2
    finally:
        await engine.cleanup()
