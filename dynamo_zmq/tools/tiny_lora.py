"""A random LoRA adapter for a (tiny) local Llama model, built with ``peft``.

``build_lora_adapter(model_dir, out_dir, rank=8, seed=0)`` loads the model with
``transformers``, wraps it in a ``peft`` ``LoraConfig`` on the attention and MLP projections,
fills both ``lora_A`` and ``lora_B`` with seeded normal values (``peft`` starts ``lora_B`` at
zero, and such an adapter changes nothing) and writes it with ``save_pretrained``:
``adapter_config.json`` and ``adapter_model.safetensors``, which vLLM loads as a
``LoRARequest``. The same arguments always give the same weights; a directory whose marker
file matches is reused. Needs ``torch``, ``transformers`` and ``peft`` (the ``test`` extra).

CLI: ``python -m dynamo_zmq tiny-lora MODEL_DIR OUT_DIR [--rank R] [--seed S] [--force]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["LORA_MARKER", "TARGET_MODULES", "build_lora_adapter", "main"]

#: Bump when the builder's output changes, so stale directories are rebuilt.
BUILDER_VERSION = 1
LORA_MARKER = ".tiny_lora.json"
#: Llama's projections the adapter adapts (vLLM packs q/k/v and gate/up; it accepts them apart).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _read_marker(out: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((out / LORA_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _save(model_dir: Path, out: Path, rank: int, seed: int, std: float) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, bias="none",
                        target_modules=list(TARGET_MODULES), task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(peft_model.named_parameters()):
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * std)
    # The base model's directory, as vLLM's and peft's loaders read it from the config.
    peft_model.peft_config["default"].base_model_name_or_path = str(model_dir)
    peft_model.save_pretrained(str(out))


def build_lora_adapter(
    model_dir: Path | str,
    out_dir: Path | str,
    rank: int = 8,
    seed: int = 0,
    *,
    std: float = 0.1,
    force: bool = False,
) -> Path:
    """Write a random LoRA adapter for the model at ``model_dir``, or reuse one built with the
    same arguments.

    Args:
        model_dir: a Hugging Face Llama model directory (``build_tiny_model``'s).
        out_dir: the adapter directory (created; a sibling temp dir is used while building).
        rank: the LoRA rank ``r`` (``lora_alpha`` is the same, so the scale is 1).
        seed: seeds ``lora_A`` and ``lora_B``.
        std: standard deviation of both matrices' values (non-zero, so the adapter changes the
            model's output).
        force: rebuild even if the directory's marker matches.

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        ValueError: a rank below 1 or a ``std`` that is not positive.
    """
    if rank < 1:
        raise ValueError(f"rank must be at least 1: {rank}")
    if not std > 0:
        raise ValueError(f"std must be positive: {std}")
    model = Path(model_dir).resolve()
    params: dict[str, Any] = {"builder_version": BUILDER_VERSION, "model_dir": str(model),
                              "rank": rank, "seed": seed, "std": std}
    out = Path(out_dir)
    if not force and _read_marker(out) == params:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _save(model, tmp, rank, seed, std)
        (tmp / LORA_MARKER).write_text(json.dumps(params, sort_keys=True) + "\n",
                                       encoding="utf-8")
        tmp.chmod(0o755)  # mkdtemp made it private
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    """``python -m dynamo_zmq tiny-lora MODEL_DIR OUT_DIR``: build (or reuse), print the
    adapter's directory."""
    parser = argparse.ArgumentParser(
        prog="python -m dynamo_zmq tiny-lora", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("model_dir", type=Path, help="the base model's directory")
    parser.add_argument("out_dir", type=Path, help="adapter directory to write")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    try:
        path = build_lora_adapter(args.model_dir, args.out_dir, args.rank, args.seed,
                                  force=args.force)
    except ValueError as exc:
        parser.error(str(exc))
    print(path)
