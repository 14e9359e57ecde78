"""LoRA adapter directories in peft's format, built locally (there is no model hub here).

``write_adapter_config(dir, rank, base_model)`` writes only ``adapter_config.json``: enough for
the mocker, which reads the adapter's rank and computes nothing (no weights).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["TARGET_MODULES", "write_adapter_config"]

#: The modules a LoRA adapter of a Llama model usually targets.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def write_adapter_config(
    dir: str | Path, rank: int, base_model: str, *, alpha: int | None = None,
    target_modules: tuple[str, ...] = TARGET_MODULES,
) -> Path:
    """Write peft's ``adapter_config.json`` for a LoRA adapter of rank ``rank`` on
    ``base_model`` into ``dir`` (made if missing); returns ``dir``.

    Args:
        dir: the adapter directory.
        rank: the LoRA rank ``r``.
        base_model: ``base_model_name_or_path`` (the model's name or directory).
        alpha: ``lora_alpha`` (default: ``2 * rank``).
        target_modules: the modules the adapter targets.
    """
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model),
        "r": rank,
        "lora_alpha": 2 * rank if alpha is None else alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(target_modules),
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
