"""The tiny LLaVA builder (``dynamo_zmq.tools.tiny_vlm``): the config vLLM and transformers
read (image token, 16 tokens an image), the tokenizer with ``<image>`` as one special token, a
chat template that writes one ``<image>`` per image part, seeded and reused when up to date, and
its CLI. That vLLM runs it is tests/test_vllm_vision.py's. Needs torch (the ``vllm`` extra)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import tests.support.needs_vllm  # noqa: F401  (torch comes with vLLM; fails it in CI without)

# isort: split

from safetensors.numpy import load_file
from transformers import AutoTokenizer

from dynamo_zmq.tools.tiny_vlm import IMAGE_TOKEN, VLM_MARKER, build_tiny_vlm, tokens_per_image


def test_config_tokenizer_template_seeded_and_reused(tmp_path: Path) -> None:
    out = build_tiny_vlm(tmp_path / "m")
    assert out == tmp_path / "m" and [p.name for p in tmp_path.iterdir()] == ["m"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlavaForConditionalGeneration"]
    assert config["image_seq_length"] == tokens_per_image(32, 8) == 16
    assert config["text_config"]["head_dim"] >= 32
    tok = AutoTokenizer.from_pretrained(str(out))
    image = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    assert image == config["image_token_index"]
    messages = [{"role": "user", "content": [{"type": "text", "text": "look "},
                                             {"type": "image_url", "image_url": {"url": "x"}},
                                             {"type": "text", "text": " here"}]}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<s><|user|>\nlook <image> here</s>\n<|assistant|>\n"
    assert tok.encode(text, add_special_tokens=False).count(image) == 1
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    build_tiny_vlm(out)  # up to date: not written again
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    first = load_file(str(out / "model.safetensors"))
    again = load_file(str(build_tiny_vlm(tmp_path / "n") / "model.safetensors"))
    assert all((first[k] == again[k]).all() for k in first)
    assert json.loads((out / VLM_MARKER).read_text())["seed"] == 0


def test_bad_arguments_and_the_cli(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="patch_size"):
        build_tiny_vlm(tmp_path / "x", patch_size=7)
    assert not (tmp_path / "x").exists()
    done = subprocess.run([sys.executable, "-m", "dynamo_zmq", "tiny-vlm", str(tmp_path / "cli"),
                           "--seed", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(tmp_path / "cli")
    assert json.loads((tmp_path / "cli" / VLM_MARKER).read_text())["seed"] == 1
