"""A tiny, random-weight LLaVA-style vision-language model directory, built locally.

``build_tiny_vlm(out_dir)`` writes what ``transformers`` and vLLM load as a Hugging Face
``LlavaForConditionalGeneration``: a small CLIP vision tower, a two-layer projector and the tiny
Llama's text config (``tiny_model``'s), with ``tiny_model``'s tokenizer plus one added special
token, ``<image>``, the image placeholder. Each image becomes ``(image_size / patch_size) ** 2``
copies of ``<image>`` in the prompt (``TOKENS_PER_IMAGE``, 16 with the defaults); the chat
template writes one ``<image>`` per image content part, the processor (``LlavaProcessor`` with a
``CLIPImageProcessor``) expands it. Seeded weights: the same arguments give the same model; a
directory whose marker file matches is reused. Needs ``torch`` and ``transformers`` (the
``test`` extra).

CLI: ``python -m dynamo_zmq tiny-vlm OUT_DIR [--seed S] [--force]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .tiny_model import BOS, EOS, PAD, UNK, build_tiny_model

__all__ = ["IMAGE_TOKEN", "VLM_MARKER", "build_tiny_vlm", "main", "tokens_per_image"]

#: Bump when the builder's output changes, so stale directories are rebuilt.
BUILDER_VERSION = 1
VLM_MARKER = ".tiny_vlm.json"
IMAGE_TOKEN = "<image>"

#: The tiny model's Zephyr-style template; a message's content may also be a list of parts
#: (``{"type": "text", "text": ...}`` or an image part), each image part an ``<image>``.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ['image', 'image_url'] %}{{ '<image>' }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def tokens_per_image(image_size: int, patch_size: int) -> int:
    """Placeholder tokens one image expands to (LLaVA's ``default`` feature strategy drops
    CLIP's class token: one per patch)."""
    return (image_size // patch_size) ** 2


def _read_marker(out: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((out / VLM_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _build(text_dir: Path, out: Path, params: dict[str, Any]) -> None:
    import torch
    import transformers

    tf: Any = transformers  # its stubs are partial: the classes are used untyped
    tokenizer = tf.PreTrainedTokenizerFast(
        tokenizer_file=str(text_dir / "tokenizer.json"), bos_token=BOS, eos_token=EOS,
        unk_token=UNK, pad_token=PAD, model_max_length=params["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = CHAT_TEMPLATE
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    text = json.loads((text_dir / "config.json").read_text(encoding="utf-8"))
    text_config = tf.LlamaConfig(**{k: v for k, v in text.items()
                                 if k not in ("architectures", "model_type", "torch_dtype")})
    text_config.vocab_size = len(tokenizer)
    size, patch, width = params["image_size"], params["patch_size"], params["vision_hidden_size"]
    vision_config = tf.CLIPVisionConfig(
        hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
        num_attention_heads=width // 32, image_size=size, patch_size=patch, projection_dim=width,
    )
    config = tf.LlavaConfig(
        vision_config=vision_config, text_config=text_config, image_token_index=image_token_id,
        vision_feature_layer=-1, vision_feature_select_strategy="default",
        projector_hidden_act="gelu", tie_word_embeddings=True,
        image_seq_length=tokens_per_image(size, patch),
    )
    config.text_config.tie_word_embeddings = True
    torch.manual_seed(params["seed"])
    model = tf.LlavaForConditionalGeneration(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(params["seed"])
    with torch.no_grad():  # larger than transformers' init, so the image shows in the output
        for _, param in sorted(model.named_parameters()):
            if param.ndim >= 2:
                param.copy_(torch.randn(param.shape, generator=gen) * params["std"])
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out))
    image_processor = tf.CLIPImageProcessor(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size},
    )
    processor = tf.LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=patch,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        image_token=IMAGE_TOKEN, chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(out))
    for path in out.iterdir():
        path.chmod(0o644)
    out.chmod(0o755)  # mkdtemp made it private
    (out / VLM_MARKER).write_text(json.dumps(params, indent=2, sort_keys=True) + "\n",
                                  encoding="utf-8")  # last: a partial build is never reused


def build_tiny_vlm(
    out_dir: Path | str,
    *,
    seed: int = 0,
    image_size: int = 32,
    patch_size: int = 8,
    vision_hidden_size: int = 64,
    std: float = 0.2,
    force: bool = False,
) -> Path:
    """Write a tiny random LLaVA model directory, or reuse one built with the same arguments.

    Args:
        out_dir: the model directory (created; a sibling temp dir is used while building).
        seed: seeds the tokenizer's training text (``build_tiny_model``) and the weights.
        image_size, patch_size: the CLIP tower's input size and patch (one placeholder token a
            patch: ``tokens_per_image``).
        vision_hidden_size: the tower's width (heads of 32).
        std: standard deviation of every weight matrix (norms are ones, biases zeros).
        force: rebuild even if the directory's marker matches.

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        ValueError: a patch that does not divide the image, or a width not a multiple of 32.
    """
    if image_size % patch_size or vision_hidden_size % 32:
        raise ValueError("patch_size must divide image_size and vision_hidden_size be k*32")
    params: dict[str, Any] = {
        "builder_version": BUILDER_VERSION, "image_size": image_size,
        "max_position_embeddings": 2048, "patch_size": patch_size, "seed": seed, "std": std,
        "vision_hidden_size": vision_hidden_size,
    }
    out = Path(out_dir)
    if not force and _read_marker(out) == params:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        text_dir = build_tiny_model(tmp / "text", seed=seed)
        model_dir = tmp / "model"
        model_dir.mkdir()
        _build(text_dir, model_dir, params)
        if force or out.exists():
            shutil.rmtree(out, ignore_errors=True)
        try:
            os.rename(model_dir, out)
        except OSError:
            if _read_marker(out) != params:
                raise
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    """``python -m dynamo_zmq tiny-vlm OUT_DIR``: build (or reuse) and print the directory."""
    parser = argparse.ArgumentParser(
        prog="python -m dynamo_zmq tiny-vlm", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("out_dir", type=Path, help="model directory to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    print(build_tiny_vlm(args.out_dir, seed=args.seed, force=args.force))


if __name__ == "__main__":
    main()
