"""A completion's ``prompt``: one (a string or a list of token ids) or a batch of them."""

from __future__ import annotations

from typing import Any

from .errors import bad_request

__all__ = ["MAX_PROMPTS", "parse_prompt", "prompt_list", "token_prompt"]

#: Most prompts in one completions request.
MAX_PROMPTS = 128

_BAD_PROMPT = (
    "'prompt' must be a string, a list of token ids, or a list of strings or of token-id lists"
)


def token_prompt(prompt: list[Any], param: str) -> list[int]:
    """``prompt`` checked as one list of token ids (``param`` names it in errors)."""
    if not prompt:
        raise bad_request(f"'{param}' must not be empty", param=param)
    try:
        lo = min(prompt)
    except TypeError:
        lo = None
    if not isinstance(lo, int) or not all(isinstance(t, int) for t in prompt):
        raise bad_request(_BAD_PROMPT, param=param, code="invalid_value")
    if lo < 0:
        raise bad_request(f"'{param}' has a negative token id {lo}", param=param)
    return prompt


def parse_prompt(prompt: str | list[Any]) -> str | list[int] | list[str | list[int]]:
    """A completion's prompt: one (a string or a list of token ids) or a batch of them (a
    list of several; a list of one is that one)."""
    if isinstance(prompt, str):
        return prompt
    if not prompt:
        raise bad_request("'prompt' must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return token_prompt(prompt, "prompt")
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(
            f"A batch of {len(prompt)} prompts is more than the {MAX_PROMPTS} one request may "
            "hold", param="prompt", code="invalid_value",
        )
    batch: list[str | list[int]] = []
    for i, item in enumerate(prompt):
        if isinstance(item, str):
            batch.append(item)
        elif isinstance(item, list):
            batch.append(token_prompt(item, "prompt" if len(prompt) == 1 else f"prompt[{i}]"))
        else:
            raise bad_request(_BAD_PROMPT, param="prompt", code="invalid_value")
    return batch[0] if len(batch) == 1 else batch


def prompt_list(prompt: Any) -> list[str | list[int]]:
    """The prompts of a parsed ``prompt`` (``parse_prompt``'s result), in order."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)
