"""A tiny, random-weight Llama model directory, built locally (there is no model hub here).

``build_tiny_model(out_dir)`` writes what ``transformers`` and vLLM load as a Hugging Face
``LlamaForCausalLM``: a byte-level BPE ``tokenizer.json`` trained on seeded English-like text,
``tokenizer_config.json`` (with a chat template), ``special_tokens_map.json``,
``generation_config.json``, ``config.json`` and ``model.safetensors`` (seeded float32 weights,
tied embeddings). It needs only ``tokenizers``, ``numpy`` and ``safetensors``. The same
arguments always give byte-identical files; a directory whose marker file matches is reused.

CLI: ``python -m dynamo_zmq tiny-model OUT_DIR [--vocab-size N] [--seed S] [--force]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

__all__ = ["BOS", "EOS", "MARKER", "PAD", "UNK", "build_tiny_model", "main"]

#: Bump when the output of the builder changes, so stale directories are rebuilt.
BUILDER_VERSION = 1
MARKER = ".tiny_model.json"
UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
#: Special tokens in id order: ``<unk>`` = 0, ``<s>`` = 1, ``</s>`` = 2, ``<pad>`` = 3.
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD)
_ROLES = ("system", "user", "assistant")

#: Zephyr-style: each turn is ``<|role|>\\n{content}</s>\\n``; generation stops at ``</s>``.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

_COMMON_WORDS = (
    "the of and to a in is it you that he was for on are with as I his they be at one have this "
    "from or had by word but what some we can out other were all there when up use your how said "
    "an each she which do their time if will way about many then them write would like so these "
    "her long make thing see him two has look more day could go come did number sound no most "
    "people my over know water than call first who may down side been now find any new work part "
    "take get place made live where after back little only round man year came show every good "
    "me give our under name very through just form sentence great think say help low line differ "
    "turn cause much mean before move right boy old too same tell does set three want air well "
    "also play small end put home read hand port large spell add even land here must big high "
    "such follow act why ask men change went light kind off need house picture try us again "
    "animal point mother world near build self earth father model token stream worker engine"
).split()
_ONSETS = (
    "b",
    "c",
    "d",
    "f",
    "g",
    "h",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "w",
    "st",
    "tr",
    "ch",
    "sh",
    "th",
    "pl",
    "gr",
)
_VOWELS = ("a", "e", "i", "o", "u", "ea", "ou", "ai", "y")
_CODAS = ("", "", "n", "r", "s", "t", "l", "nd", "ng", "st", "ck", "m")


def _corpus(seed: int, sentences: int = 4000) -> list[str]:
    """Seeded English-like text: common words, invented words, numbers and chat markers."""
    rng = random.Random(seed)
    invented = [
        "".join(
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
            for _ in range(rng.randint(1, 3))
        )
        for _ in range(600)
    ]
    lines: list[str] = []
    for _ in range(sentences):
        words = [
            rng.choice(_COMMON_WORDS) if rng.random() < 0.7 else rng.choice(invented)
            for _ in range(rng.randint(4, 16))
        ]
        if rng.random() < 0.15:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 2025)))
        if rng.random() < 0.2:
            words[rng.randrange(len(words))] += ","
        sentence = " ".join(words)
        sentence = sentence[0].upper() + sentence[1:] + rng.choice(".....?!")
        if rng.random() < 0.1:
            sentence = f"<|{rng.choice(_ROLES)}|>\n{sentence}"
        lines.append(sentence)
    return lines


def _train_tokenizer(vocab_size: int, seed: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_corpus(seed), trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS}:0 $A:0",
                pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
                special_tokens=[(BOS, bos_id)],
            ),
        ]
    )
    return tokenizer


def _weights(
    *,
    vocab_size: int,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    std: float,
    seed: int,
) -> dict[str, np.ndarray]:
    """HF Llama tensor names and shapes (``[out_features, in_features]``), seeded."""
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": normal(vocab_size, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        tensors[f"{p}.self_attn.q_proj.weight"] = normal(heads * head_dim, hidden)
        tensors[f"{p}.self_attn.k_proj.weight"] = normal(kv_heads * head_dim, hidden)
        tensors[f"{p}.self_attn.v_proj.weight"] = normal(kv_heads * head_dim, hidden)
        tensors[f"{p}.self_attn.o_proj.weight"] = normal(hidden, heads * head_dim)
        tensors[f"{p}.mlp.gate_proj.weight"] = normal(intermediate, hidden)
        tensors[f"{p}.mlp.up_proj.weight"] = normal(intermediate, hidden)
        tensors[f"{p}.mlp.down_proj.weight"] = normal(hidden, intermediate)
        tensors[f"{p}.input_layernorm.weight"] = np.ones(hidden, dtype=np.float32)
        tensors[f"{p}.post_attention_layernorm.weight"] = np.ones(hidden, dtype=np.float32)
    tensors["model.norm.weight"] = np.ones(hidden, dtype=np.float32)
    return tensors


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _build(out: Path, params: dict[str, Any]) -> None:
    tokenizer = _train_tokenizer(params["vocab_size"], params["seed"])
    tokenizer.save(str(out / "tokenizer.json"))
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    max_len = params["max_position_embeddings"]
    _write_json(
        out / "tokenizer_config.json",
        {
            "added_tokens_decoder": {
                str(ids[token]): {
                    "content": token,
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                }
                for token in SPECIAL_TOKENS
            },
            "bos_token": BOS,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": EOS,
            "model_max_length": max_len,
            "pad_token": PAD,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "unk_token": UNK,
        },
    )
    _write_json(
        out / "special_tokens_map.json",
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK},
    )
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD]},
    )
    hidden, heads = params["hidden_size"], params["num_attention_heads"]
    _write_json(
        out / "config.json",
        {
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": ids[BOS],
            "dtype": "float32",
            "eos_token_id": ids[EOS],
            "head_dim": hidden // heads,
            "hidden_act": "silu",
            "hidden_size": hidden,
            "initializer_range": params["std"],
            "intermediate_size": params["intermediate_size"],
            "max_position_embeddings": max_len,
            "mlp_bias": False,
            "model_type": "llama",
            "num_attention_heads": heads,
            "num_hidden_layers": params["num_hidden_layers"],
            "num_key_value_heads": params["num_key_value_heads"],
            "pad_token_id": ids[PAD],
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-6,
            "rope_scaling": None,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
            "torch_dtype": "float32",
            "use_cache": True,
            "vocab_size": vocab,
        },
    )
    tensors = _weights(
        vocab_size=vocab,
        hidden=hidden,
        intermediate=params["intermediate_size"],
        layers=params["num_hidden_layers"],
        heads=heads,
        kv_heads=params["num_key_value_heads"],
        std=params["std"],
        seed=params["seed"],
    )
    # transformers refuses safetensors files without a "format" in their metadata.
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for path in out.iterdir():
        path.chmod(0o644)
    out.chmod(0o755)  # mkdtemp made it private
    _write_json(out / MARKER, params)  # last: a partial build is never reused


def _read_marker(out: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((out / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def build_tiny_model(
    out_dir: Path | str,
    *,
    vocab_size: int = 512,
    seed: int = 0,
    hidden_size: int = 64,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 2,
    num_hidden_layers: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    std: float = 0.02,
    force: bool = False,
) -> Path:
    """Write a tiny random Llama model directory, or reuse one built with the same arguments.

    Args:
        out_dir: the model directory (created; a sibling temp dir is used while building).
        vocab_size: target tokenizer vocabulary, special tokens and 256 byte tokens included;
            ``config.json`` gets the size the tokenizer actually reached.
        seed: seeds the training text and the weights.
        hidden_size, num_attention_heads, num_key_value_heads, num_hidden_layers,
        intermediate_size, max_position_embeddings: the Llama config.
        std: standard deviation of the random weights (norms are ones).
        force: rebuild even if the directory's marker matches.

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        ValueError: a vocabulary too small for byte-level BPE, or heads that don't divide.
    """
    minimum = 256 + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum} (256 bytes + special tokens)")
    if hidden_size % num_attention_heads or num_attention_heads % num_key_value_heads:
        raise ValueError("hidden_size must divide by heads, and heads by key/value heads")
    params: dict[str, Any] = {
        "builder_version": BUILDER_VERSION,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "num_attention_heads": num_attention_heads,
        "num_hidden_layers": num_hidden_layers,
        "num_key_value_heads": num_key_value_heads,
        "seed": seed,
        "std": std,
        "vocab_size": vocab_size,
    }
    out = Path(out_dir)
    if not force and _read_marker(out) == params:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _build(tmp, params)
        try:
            os.rename(tmp, out)  # atomic when ``out`` does not exist (or is an empty dir)
            return out
        except OSError:
            if not force and _read_marker(out) == params:
                return out  # built meanwhile by someone else
        out.mkdir(exist_ok=True)
        (out / MARKER).unlink(missing_ok=True)
        for path in sorted(tmp.iterdir()):
            if path.name != MARKER:
                os.replace(path, out / path.name)
        os.replace(tmp / MARKER, out / MARKER)
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    """``python -m dynamo_zmq tiny-model OUT_DIR``: build (or reuse) and print the directory."""
    parser = argparse.ArgumentParser(
        prog="python -m dynamo_zmq tiny-model", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("out_dir", type=Path, help="model directory to write")
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    try:
        path = build_tiny_model(
            args.out_dir, vocab_size=args.vocab_size, seed=args.seed, force=args.force
        )
    except ValueError as exc:
        parser.error(str(exc))
    print(path)

