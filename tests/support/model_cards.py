"""Model directories that make another model card (another checksum) under the same name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from dynamo_zmq.llm import build_card


def other_card_model(tiny_model: Path, tmp_path: Path) -> Path:
    """A copy of the tiny model with another context length: same name, another card."""
    other = tmp_path / "other-model"
    shutil.copytree(tiny_model, other)
    config = json.loads((other / "config.json").read_text())
    config["max_position_embeddings"] = 1024
    (other / "config.json").write_text(json.dumps(config))
    assert build_card(other, "tiny").checksum != build_card(tiny_model, "tiny").checksum
    return other
