"""Configuring a worker: from code (the backend-common document's ``from_args`` -> ``(engine,
WorkerConfig)`` and ``run``), the native-processing document's flag names, and ``--model-path``
as a Hugging Face model id found in the local cache (offline)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from dynamo_zmq import errors
from dynamo_zmq.llm import ModelCard
from dynamo_zmq.worker import WorkerConfig, from_args
from engines.mocker import MockerEngine

ENGINES = "tests.support.engines"


def request(tokens: list[int], max_tokens: int) -> dict:
    return {"token_ids": tokens, "stop": {"max_tokens": max_tokens}}


async def generate_once(client, tokens: list[int], max_tokens: int) -> list[dict]:
    return [r.data() async for r in await client.generate(request(tokens, max_tokens))]


def worker(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a worker that is expected to stop at once (a usage error)."""
    return subprocess.run([sys.executable, "-m", "dynamo_zmq.worker", *args],
                          capture_output=True, text=True, timeout=60, env=env)


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
    with pytest.raises(errors.InvalidArgument, match="--migration-limit must be >= 0"):
        WorkerConfig(migration_limit=-1)
    _, config = from_args(["--model-path", str(tiny_model), "--migration-limit", "2"])
    assert config.migration_limit == 2
    assert from_args(["--model-path", str(tiny_model)])[1].migration_limit is None


# -- native processing flags -------------------------------------------------------------------


async def test_native_framework_processing_flags(namespace, spawn, make_runtime, tiny_model):
    native = f"{ENGINES}:NativeEchoTestEngine"
    base = ["--model-path", str(tiny_model), "--namespace", namespace, "--host", "127.0.0.1"]
    proc = spawn("-m", "dynamo_zmq.worker", "--engine", native, *base,
                 "--native-framework-processing")
    rt = make_runtime(static=(proc.address,))
    await (await rt.endpoint(f"{namespace}.backend.generate").client()).wait_for_instances(15)
    (peer,) = [p for p in await rt.peers() if p.description]
    (info,) = [e for e in peer.description.endpoints if e.name == "generate"]
    assert info.metadata["engine"]["extra"]["native_processing"] is True

    res = worker("--engine", "mocker", *base, "--native-framework-processing")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "error: --native-framework-processing: the mocker engine has no native processing" \
        in res.stderr
    res = worker("--engine", native, *base, "--trtllm-processing")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert ("error: --trtllm-processing asks the trtllm engine for its native processing, but "
            "this worker runs native-echo (use --native-framework-processing)") in res.stderr


def test_native_processing_spellings_and_variable(tiny_model, monkeypatch):
    native = f"{ENGINES}:NativeEchoTestEngine"
    base = ["--engine", native, "--model-path", str(tiny_model)]
    for flag in ("--native-framework-processing", "--native-processing"):
        engine, _ = from_args([*base, flag])
        assert engine.native_processing is True
    assert from_args(base)[0].native_processing is False
    with pytest.raises(errors.InvalidArgument, match="--sglang-processing asks the sglang"):
        from_args([*base, "--sglang-processing"])
    monkeypatch.setenv("DYN_NATIVE_FRAMEWORK_PROCESSING", "1")
    assert from_args(base)[0].native_processing is True


# -- --model-path as a Hugging Face model id ------------------------------------------------


def fake_hub_cache(root: Path, repo_id: str, model_dir: Path) -> Path:
    """``root`` laid out as the Hugging Face hub cache holding ``model_dir`` as ``repo_id``'s
    main revision (what ``hf download`` leaves, with plain files for links)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(model_dir, repo / "snapshots" / commit)
    return root


async def test_model_path_may_be_a_hub_id_in_the_local_cache(
    namespace, spawn, make_runtime, tiny_model, tmp_path
):
    cache = fake_hub_cache(tmp_path / "hub", "tiny-org/tiny-llama", tiny_model)
    proc = spawn("-m", "dynamo_zmq.worker", "--engine", "mocker", "--speedup-ratio", "1000",
                 "--model-path", "tiny-org/tiny-llama", "--namespace", namespace,
                 "--host", "127.0.0.1", env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    rt = make_runtime(static=(proc.address,))
    client = await rt.endpoint(f"{namespace}.backend.generate").client()
    await client.wait_for_instances(timeout=15)
    chunks = await generate_once(client, list(range(1, 20)), 5)
    assert chunks[-1]["finish_reason"] == "length"
    (peer,) = [p for p in await rt.peers() if p.description]
    (info,) = [e for e in peer.description.endpoints if e.name == "generate"]
    card = msgspec.convert(info.metadata["model_card"], ModelCard)
    assert card.name == "tiny-org/tiny-llama"  # served under the hub id
    assert {f.name for f in card.files} >= {"tokenizer.json", "config.json"}


def test_a_hub_id_missing_from_the_cache_is_one_clear_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HF_HOME")}
    env["HF_HOME"] = str(tmp_path / "hf-home")  # the cache is HF_HOME/hub
    res = worker("--engine", "mocker", "--model-path", "tiny-org/not-downloaded", env=env)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert line == (
        "error: --model-path 'tiny-org/not-downloaded' is neither a directory nor a model in "
        f"the local Hugging Face cache ({tmp_path / 'hf-home' / 'hub'}); download it first: "
        "hf download tiny-org/not-downloaded"
    )
    res = worker("--engine", "mocker", "--model-path", str(tmp_path / "missing"), env=env)
    assert res.returncode == 2 and "is not a directory" in res.stderr
