"""The random LoRA adapter builder (``dynamo_zmq.tools.tiny_lora``): ``peft``'s files for the tiny
model, both matrices non-zero (``peft`` starts ``lora_B`` at zero: such an adapter changes
nothing), seeded, reused when up to date, and its CLI. That the adapter changes vLLM's output is
tests/test_vllm_lora.py's. Needs torch (the ``vllm`` extra), like the vLLM tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import tests.support.needs_vllm  # noqa: F401  (torch comes with vLLM; fails it in CI without)

# isort: split

from safetensors.numpy import load_file

from dynamo_zmq.tools.tiny_lora import LORA_MARKER, TARGET_MODULES, build_lora_adapter


def _weights(path: Path) -> dict:
    return load_file(str(path / "adapter_model.safetensors"))


def test_adapter_files_rank_and_non_zero_matrices(tiny_model: Path, tmp_path: Path) -> None:
    out = build_lora_adapter(tiny_model, tmp_path / "a", rank=8, seed=0)
    assert out == tmp_path / "a"
    assert {"adapter_config.json", "adapter_model.safetensors", LORA_MARKER} <= {
        p.name for p in out.iterdir()}
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 8 and set(config["target_modules"]) == set(TARGET_MODULES)
    weights = _weights(out)
    a = [w for name, w in weights.items() if "lora_A" in name]
    b = [w for name, w in weights.items() if "lora_B" in name]
    assert len(a) == len(b) == 2 * len(TARGET_MODULES)  # the tiny model's two layers
    assert all(w.shape[0] == 8 for w in a) and all(w.shape[1] == 8 for w in b)
    assert all(abs(w).max() > 0 for w in a + b)
    assert [p.name for p in tmp_path.iterdir()] == ["a"]  # no temp dirs left behind


def test_seeded_and_reused(tiny_model: Path, tmp_path: Path) -> None:
    first = _weights(build_lora_adapter(tiny_model, tmp_path / "a", seed=3))
    stamp = (tmp_path / "a" / "adapter_model.safetensors").stat().st_mtime_ns
    build_lora_adapter(tiny_model, tmp_path / "a", seed=3)  # up to date: not written again
    assert (tmp_path / "a" / "adapter_model.safetensors").stat().st_mtime_ns == stamp
    again = _weights(build_lora_adapter(tiny_model, tmp_path / "b", seed=3))
    other = _weights(build_lora_adapter(tiny_model, tmp_path / "a", seed=4))  # rebuilt
    assert all((first[k] == again[k]).all() for k in first)
    assert any((first[k] != other[k]).any() for k in first)


def test_bad_arguments_and_the_cli(tiny_model: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="rank"):
        build_lora_adapter(tiny_model, tmp_path / "x", rank=0)
    assert not (tmp_path / "x").exists()
    done = subprocess.run([sys.executable, "-m", "dynamo_zmq", "tiny-lora", str(tiny_model),
                           str(tmp_path / "cli"), "--rank", "16"],
                          capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == str(tmp_path / "cli")
    assert json.loads((tmp_path / "cli" / "adapter_config.json").read_text())["r"] == 16
    bad = subprocess.run([sys.executable, "-m", "dynamo_zmq", "tiny-lora", str(tiny_model),
                          str(tmp_path / "y"), "--rank", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "rank" in bad.stderr
