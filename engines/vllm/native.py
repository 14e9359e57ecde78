"""Native processing on the frontend side: the model's own Hugging Face tokenizer.

With ``--native-processing`` a vLLM worker detokenizes and applies stop strings itself. The
frontend should then build prompts with the same tokenizer vLLM uses (``transformers``'
``AutoTokenizer``, with the model's chat template), so that prompts and texts match what
``vllm serve`` would produce. ``NativeTokenizer`` is that adapter:

    tok = NativeTokenizer(model_dir)
    ids = tok.apply_chat_template(messages, tools=None, add_generation_prompt=True)
    ids = tok.encode("a completion prompt")

It needs ``transformers`` (installed with the ``vllm`` extra) and is imported only on use.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dynamo_zmq import errors

from ._options import INSTALL_HINT

__all__ = ["NativeTokenizer"]


class NativeTokenizer:
    """The model's ``transformers`` tokenizer, with the two calls a frontend needs.

    Args:
        model_dir: the model directory (the one the worker serves; ``tokenizer_config.json``
            carries the chat template).
        trust_remote_code: passed to ``AutoTokenizer.from_pretrained``.

    Raises:
        InvalidArgument: ``transformers`` is missing, or the directory holds no tokenizer.
    """

    def __init__(self, model_dir: str | Path, trust_remote_code: bool = False) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise errors.InvalidArgument(
                f"native processing needs transformers ({exc}); {INSTALL_HINT}"
            ) from exc
        try:
            self.tokenizer: Any = AutoTokenizer.from_pretrained(
                str(model_dir), trust_remote_code=trust_remote_code
            )
        except (OSError, ValueError) as exc:
            raise errors.InvalidArgument(f"no tokenizer in {model_dir}: {exc}") from exc
        self.model_dir = Path(model_dir)

    def __repr__(self) -> str:
        return f"NativeTokenizer({str(self.model_dir)!r})"

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.tokenizer.eos_token_id
        return [] if eos is None else [int(eos)]

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered chat, as vLLM's chat endpoint renders and tokenizes it
        (the template's own special tokens, no extra BOS).

        Raises:
            InvalidArgument: the template rejects the messages (e.g. an unknown role).
        """
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages), tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs,
            )
        except Exception as exc:  # jinja2 errors, template raise_exception(...)
            raise errors.InvalidArgument(f"chat template failed: {exc}") from exc
        return self.encode(str(text), add_special_tokens=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (a completion prompt gets the tokenizer's BOS, as in vLLM)."""
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))
