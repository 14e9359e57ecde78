"""Configuring a worker from code: the backend-common document's ``from_args`` -> ``(engine,
WorkerConfig)`` and ``run``."""

from __future__ import annotations

import pytest

from dynamo_zmq import errors
from dynamo_zmq.worker import WorkerConfig, from_args
from engines.mocker import MockerEngine


def request(tokens: list[int], max_tokens: int) -> dict:
    return {"token_ids": tokens, "stop": {"max_tokens": max_tokens}}


async def generate_once(client, tokens: list[int], max_tokens: int) -> list[dict]:
    return [r.data() async for r in await client.generate(request(tokens, max_tokens))]


# -- from_args + run: a worker configured from code ------------------------------------------


async def test_a_mocker_worker_built_from_code_serves(namespace, spawn, make_runtime, tiny_model):
    flags = spawn("-m", "tests.support.embedded_worker", "args", "--model-path", str(tiny_model),
                  "--namespace", namespace, "--host", "127.0.0.1", "--speedup-ratio", "1000")
    code = spawn("-m", "tests.support.embedded_worker", "code", namespace, str(tiny_model))
    rt = make_runtime()
    for path, proc in ((f"{namespace}.backend.generate", flags),
                       (f"{namespace}.embedded.generate", code)):
        client = await rt.endpoint(path).client()
        assert await client.wait_for_instances(timeout=15) == [proc.instance_id]
        chunks = await generate_once(client, list(range(1, 20)), 6)
        assert sum(len(c.get("token_ids", [])) for c in chunks) == 6
        assert chunks[-1]["finish_reason"] == "length"


def test_from_args_gives_the_engine_and_a_typed_worker_config(tiny_model):
    engine, config = MockerEngine.from_args([
        "--model-path", str(tiny_model), "--namespace", "ns1", "--component", "c1",
        "--grace-period", "2", "--host", "127.0.0.1", "--block-size", "16",
    ])
    assert isinstance(engine, MockerEngine) and isinstance(config, WorkerConfig)
    assert (config.namespace, config.component, config.endpoint) == ("ns1", "c1", "generate")
    assert config.model_path == str(tiny_model) and config.runtime.grace_period == 2.0
    assert config.runtime.host == "127.0.0.1" and engine.config.block_size == 16
    # the generic form picks the engine by --engine
    engine, _ = from_args(["--engine", "mocker", "--model-path", str(tiny_model)])
    assert type(engine) is MockerEngine
    with pytest.raises(errors.InvalidArgument, match="--engine vllm given to MockerEngine"):
        MockerEngine.from_args(["--engine", "vllm", "--model-path", str(tiny_model)])
    with pytest.raises(errors.InvalidArgument, match=r"namespace name 'a\.b'"):
        WorkerConfig(namespace="a.b")
    with pytest.raises(errors.InvalidArgument, match="--load-interval must be"):
        WorkerConfig(load_interval=10)
    with pytest.raises(errors.InvalidArgument, match="disaggregation mode"):
        WorkerConfig(disaggregation_mode="both")
