"""The tiny local Llama model: tokenizer, chat template, config, weights, determinism, reuse."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from dynamo_zmq.tools.tiny_model import BOS, EOS, MARKER, PAD, UNK, build_tiny_model

FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
    MARKER,
}
TEXTS = [
    "Hello world, how are you today?",
    "The worker sent 128 tokens to the router.",
    "  leading spaces, double  spaces\n\nand new lines\tand tabs ",
    "Ünïcödé, emoji 🤖 and 中文 survive byte-level BPE.",
    "",
]


def checksums(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def load_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def test_directory_is_complete(tiny_model: Path):
    assert {p.name for p in tiny_model.iterdir()} == FILES


def test_tokenizer_round_trips_text(tiny_model: Path):
    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert ids[0] == tok.token_to_id(BOS)
        assert tok.decode(ids) == text
        assert tok.encode(text, add_special_tokens=False).ids == ids[1:]
    # Real BPE merges, not just bytes.
    assert len(tok.encode("the worker and the engine", add_special_tokens=False).ids) < 12


def test_special_tokens(tiny_model: Path):
    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    assert [tok.token_to_id(t) for t in (UNK, BOS, EOS, PAD)] == [0, 1, 2, 3]
    # Specials are atomic and skipped on decode.
    assert tok.encode(f"hi{EOS}", add_special_tokens=False).ids[-1] == 2
    assert tok.decode(tok.encode(f"hi{EOS}").ids) == "hi"
    cfg = load_json(tiny_model / "tokenizer_config.json")
    assert cfg["bos_token"] == BOS and cfg["eos_token"] == EOS
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["model_max_length"] == 2048
    assert {v["content"] for v in cfg["added_tokens_decoder"].values()} == {UNK, BOS, EOS, PAD}
    special = load_json(tiny_model / "special_tokens_map.json")
    assert special == {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    gen = load_json(tiny_model / "generation_config.json")
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)


def test_config_matches_tokenizer(tiny_model: Path):
    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    cfg = load_json(tiny_model / "config.json")
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["vocab_size"] == tok.get_vocab_size(with_added_tokens=True) == 512
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (
        64,
        2,
        2,
    )
    assert cfg["head_dim"] == 32 and cfg["num_hidden_layers"] == 2
    assert cfg["intermediate_size"] == 128 and cfg["max_position_embeddings"] == 2048
    assert cfg["tie_word_embeddings"] is True and cfg["torch_dtype"] == "float32"
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)


def test_weights_have_llama_names_and_shapes(tiny_model: Path):
    cfg = load_json(tiny_model / "config.json")
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q_out = cfg["num_attention_heads"] * cfg["head_dim"]
    kv_out = cfg["num_key_value_heads"] * cfg["head_dim"]
    expected = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        expected |= {
            f"{p}.self_attn.q_proj.weight": (q_out, hidden),
            f"{p}.self_attn.k_proj.weight": (kv_out, hidden),
            f"{p}.self_attn.v_proj.weight": (kv_out, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, q_out),
            f"{p}.mlp.gate_proj.weight": (inter, hidden),
            f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.post_attention_layernorm.weight": (hidden,),
        }
    tensors = load_file(str(tiny_model / "model.safetensors"))
    assert {name: t.shape for name, t in tensors.items()} == expected
    assert all(t.dtype == np.float32 for t in tensors.values())
    assert "lm_head.weight" not in tensors
    assert np.all(tensors["model.norm.weight"] == 1.0)
    embed = tensors["model.embed_tokens.weight"]
    assert 0.015 < float(embed.std()) < 0.025 and abs(float(embed.mean())) < 0.005
    with open(tiny_model / "model.safetensors", "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        assert json.loads(f.read(header_len))["__metadata__"] == {"format": "pt"}


def test_chat_template_renders(tiny_model: Path):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    cfg = load_json(tiny_model / "tokenizer_config.json")
    # The environment transformers renders chat templates with.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(cfg["chat_template"])
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello there!"},
    ]
    prompt = template.render(
        messages=messages, add_generation_prompt=True, bos_token=BOS, eos_token=EOS
    )
    assert prompt == (
        "<s><|system|>\nYou are terse.</s>\n<|user|>\nHello there!</s>\n<|assistant|>\n"
    )
    without = template.render(
        messages=messages, add_generation_prompt=False, bos_token=BOS, eos_token=EOS
    )
    assert without == prompt.removesuffix("<|assistant|>\n")
    assert (
        jinja2.Template(cfg["chat_template"])
        .render(
            messages=[*messages, {"role": "assistant", "content": "Hi."}],
            bos_token=BOS,
            eos_token=EOS,
        )
        .endswith("<|assistant|>\nHi.</s>\n")
    )
    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    ids = tok.encode(prompt, add_special_tokens=False).ids
    assert ids[0] == 1 and ids.count(2) == 2
    assert tok.decode(ids, skip_special_tokens=False) == prompt


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path):
    a = build_tiny_model(tmp_path / "a", seed=7, vocab_size=300)
    b = build_tiny_model(tmp_path / "b", seed=7, vocab_size=300)
    c = build_tiny_model(tmp_path / "c", seed=8, vocab_size=300)
    assert checksums(a) == checksums(b)
    assert load_json(a / "config.json")["vocab_size"] == 300
    differ = {n for n, h in checksums(a).items() if checksums(c)[n] != h}
    assert {"model.safetensors", "tokenizer.json", MARKER} <= differ


def test_reuses_a_matching_directory_and_rebuilds_a_stale_one(tmp_path: Path):
    out = tmp_path / "m"
    build_tiny_model(out, vocab_size=300)
    weights = out / "model.safetensors"
    weights.write_bytes(b"tampered")  # reuse trusts the marker; it does not re-hash
    assert build_tiny_model(out, vocab_size=300) == out
    assert weights.read_bytes() == b"tampered"
    build_tiny_model(out, vocab_size=300, force=True)
    assert weights.read_bytes() != b"tampered"
    build_tiny_model(out, vocab_size=320)
    assert load_json(out / "config.json")["vocab_size"] == 320
    assert load_json(out / MARKER)["vocab_size"] == 320
    assert {p.name for p in tmp_path.iterdir()} == {"m"}  # no temp dirs left behind


def test_rejects_bad_arguments(tmp_path: Path):
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_model(tmp_path / "x", vocab_size=100)
    with pytest.raises(ValueError, match="divide"):
        build_tiny_model(tmp_path / "x", hidden_size=63)
    assert not (tmp_path / "x").exists()


def test_cli(tmp_path: Path):
    out = tmp_path / "cli"
    done = subprocess.run(
        [sys.executable, "-m", "dynamo_zmq", "tiny-model", str(out), "--vocab-size", "300"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.strip() == str(out)
    assert {p.name for p in out.iterdir()} == FILES
    bad = subprocess.run(
        [sys.executable, "-m", "dynamo_zmq", "tiny-model", str(tmp_path / "y"),
         "--vocab-size", "10"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "vocab_size" in bad.stderr
