"""Preprocessing: OpenAI requests to ``PreprocessedRequest`` (chat template, tokens, options).

A ``Preprocessor`` is built once per model from its tokenizer files (``tokenizer.json``,
``tokenizer_config.json``, ``chat_template.jinja``, ``generation_config.json``, ``config.json``)
and compiles the chat template once, in the environment ``_chat_template.py`` builds as Hugging
Face ``transformers`` does. Chat prompts are tokenized without special tokens (the template
carries them; images: ``_image_prompt.py``); text completion prompts with them. It owns the
translation of sampling, stop and length options, and the context-length checks. Each request
carries its card's checksum (``mdcsum``), so a worker serving another card refuses it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer

from ..llm import (
    Capability,
    ModelCard,
    OutputOptions,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from ._chat_template import RESERVED, continue_final, function_dict, message_dict
from ._chat_template import template_environment as template_environment
from ._image_prompt import Vision, image_chat
from ._limits import text_chars
from ._logprobs import requested_logprobs
from ._model_files import SPECIAL_TOKENS, id_list, longest_token, read_json, token_text, unique
from ._model_files import NativeTokenizerLike as NativeTokenizerLike
from ._structured import constraint
from .errors import bad_request, prompt_too_long
from .protocol import ChatCompletionRequest, CompletionRequest

__all__ = ["Preprocessor", "Require", "template_environment"]

#: ``ModelEntry.require``: refuses a parameter whose capability the serving engine lacks.
Require = Callable[[str, str], None]


class Preprocessor:
    """Turns parsed OpenAI requests into ``PreprocessedRequest`` for one model.

    Args:
        model_dir: directory holding the model's tokenizer and config files.
        card: the model's card; ``card.name`` is the served name, and ``card.context_length``
            (else ``config.json``'s ``max_position_embeddings``) bounds prompt plus output.

    Attributes:
        tokenizer: the ``tokenizers.Tokenizer``.
        eos_token_ids: end-of-sequence ids (generation_config, config, then the tokenizer's).
        bos_token / eos_token: the special tokens' text, or None.
        context_length: the maximum of prompt plus output tokens (0 when unknown: no limit).
        max_prompt_chars: the longest text that can tokenize within the context length (its
            length times the longest vocabulary entry; 0: no limit); longer is refused
            untokenized (``_limits``).
        vocab_size: token ids at or above it are rejected in token prompts.
    """

    def __init__(self, model_dir: Path | str, card: ModelCard) -> None:
        root = Path(model_dir)
        self.card = card
        self.model = card.name
        self.native: NativeTokenizerLike | None = None
        self.tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
        tok_config = read_json(root / "tokenizer_config.json")
        special_map = read_json(root / "special_tokens_map.json")
        gen_config = read_json(root / "generation_config.json")
        config = read_json(root / "config.json")

        self.special_tokens: dict[str, Any] = {}
        for name in SPECIAL_TOKENS:
            value = token_text(tok_config.get(name, special_map.get(name)))
            if value is not None:
                self.special_tokens[name] = value
        self.bos_token: str | None = self.special_tokens.get("bos_token")
        self.eos_token: str | None = self.special_tokens.get("eos_token")

        eos = id_list(gen_config.get("eos_token_id")) + id_list(config.get("eos_token_id"))
        if isinstance(self.eos_token, str):
            tok_eos = self.tokenizer.token_to_id(self.eos_token)
            if tok_eos is not None:
                eos.append(tok_eos)
        self.eos_token_ids: list[int] = unique(eos)

        max_pos = config.get("max_position_embeddings")
        self.context_length: int = card.context_length or (
            max_pos if isinstance(max_pos, int) and max_pos > 0 else 0
        )
        vocab = config.get("vocab_size")
        self.vocab_size: int = max(
            self.tokenizer.get_vocab_size(with_added_tokens=True),
            vocab if isinstance(vocab, int) else 0,
        )
        self.max_prompt_chars: int = self.context_length * longest_token(self.tokenizer)

        self._env = template_environment()
        self._templates: dict[str, jinja2.Template] = {}
        jinja_file = root / "chat_template.jinja"
        source: Any = (
            jinja_file.read_text(encoding="utf-8")
            if jinja_file.is_file()
            else tok_config.get("chat_template")
        )
        if isinstance(source, str):
            self._templates["default"] = self._env.from_string(source)
        elif isinstance(source, list):
            for item in source:
                if isinstance(item, dict) and isinstance(item.get("template"), str):
                    self._templates[str(item.get("name"))] = self._env.from_string(item["template"])

    def __repr__(self) -> str:
        return f"Preprocessor(model={self.model!r}, context_length={self.context_length})"

    # -- chat -----------------------------------------------------------------------------------

    def _template(self, with_tools: bool) -> jinja2.Template:
        if with_tools and "tool_use" in self._templates:
            return self._templates["tool_use"]
        if "default" in self._templates:
            return self._templates["default"]
        if len(self._templates) == 1:
            return next(iter(self._templates.values()))
        raise bad_request(
            f"Model {self.model!r} has no chat template; use /v1/completions instead",
            param="messages",
        )

    def render(self, req: ChatCompletionRequest, messages: list[dict[str, Any]] | None = None
               ) -> str:
        """The chat prompt text of ``req`` (its ``messages`` as given, else as templates read
        them), rendered with the model's template.

        Raises:
            HttpError: 400 when the model has no template or the template rejects the request.
        """
        tools = None
        if req.tools:
            tools = [{"type": t.type, "function": function_dict(t.function)} for t in req.tools]
        template = self._template(tools is not None)
        messages = messages or [message_dict(m) for m in req.messages]
        variables: dict[str, Any] = dict(self.special_tokens)
        if req.chat_template_kwargs:
            variables.update(
                (k, v) for k, v in req.chat_template_kwargs.items() if k not in RESERVED
            )
        variables["messages"] = messages
        variables["tools"] = tools
        variables["documents"] = req.documents
        variables["add_generation_prompt"] = req.add_generation_prompt is not False
        try:
            text = template.render(variables)
        except jinja2.TemplateError as exc:
            raise bad_request(
                f"Chat template error: {exc.message or exc}", param="messages"
            ) from exc
        except Exception as exc:  # a template's own bug on this input: the request can't render
            raise bad_request(
                f"Chat template failed on this request: {type(exc).__name__}: {exc}",
                param="messages",
            ) from exc
        if req.continue_final_message:
            text = continue_final(text, messages[-1]["content"])
        return text

    def chat(
        self, req: ChatCompletionRequest, require: Require | None = None,
        images: Sequence[bytes] = (), vision: Vision | None = None,
    ) -> PreprocessedRequest:
        """Render, tokenize and translate a parsed chat request.

        Args:
            req: the parsed request.
            require: checks a parameter's capability against the serving engine
                (``ModelEntry.require``); None: no check.
            images: the request's images in prompt order (``_images.load_images``), each
                expanded as ``vision`` says (``_image_prompt.py``); they go in ``media``.

        Raises:
            HttpError: 400 (template or tokenization errors, a capability the engine lacks),
                413 (context length exceeded).
        """
        media = None
        if images and vision is not None:
            token_ids, media = image_chat(self, req, images, vision)
        elif self.native is not None:
            token_ids = self.native_chat(req)
        else:
            text = self.render(req)
            text_chars(self, [("messages", text)])  # tools and template add text: 413 here
            token_ids = self._encode(text, bool(req.add_special_tokens), "messages")
        max_tokens = req.max_completion_tokens
        name = "max_completion_tokens"
        if max_tokens is None:
            max_tokens, name = req.max_tokens, "max_tokens"
        pre = self._build(req, token_ids, max_tokens, name, "messages", require)
        pre.media = media
        return pre

    # -- completions ----------------------------------------------------------------------------

    def completion(
        self, req: CompletionRequest, require: Require | None = None
    ) -> PreprocessedRequest:
        """Tokenize (or check) the prompt and translate a parsed completion request.

        Args:
            req: the parsed request.
            require: as for ``chat``.

        Raises:
            HttpError: 400 (bad token ids, empty prompt, a capability the engine lacks),
                413 (context length exceeded).
        """
        prompt = req.prompt
        if isinstance(prompt, str) and self.native is not None:
            token_ids = self._native_call(self.native.encode, prompt, "prompt")
        elif isinstance(prompt, str):
            add_special = req.add_special_tokens is not False
            token_ids = self._encode(prompt, add_special, "prompt")
        else:
            # parse_completion leaves a str or a list of ints (CompletionRequest)
            token_ids = list(prompt)  # type: ignore[arg-type]
            if not token_ids:
                raise bad_request("'prompt' must not be empty", param="prompt")
            top = max(token_ids)
            if self.vocab_size and top >= self.vocab_size:
                raise bad_request(
                    f"Token id {top} is out of vocabulary (size {self.vocab_size})",
                    param="prompt",
                    code="invalid_value",
                )
        return self._build(req, token_ids, req.max_tokens, "max_tokens", "prompt", require)

    # -- embeddings -----------------------------------------------------------------------------

    def embedding_tokens(self, item: str | list[int], add_special_tokens: bool) -> list[int]:
        """The token ids of one ``/v1/embeddings`` input (a string is tokenized, token ids are
        checked against the vocabulary and the context length).

        Raises:
            HttpError: 400 (tokenization, out-of-vocabulary id), 413 (context length exceeded).
        """
        if isinstance(item, str):
            if self.native is not None:
                ids = self._native_call(self.native.encode, item, "input")
            else:
                ids = self._encode(item, add_special_tokens, "input")
        else:
            ids, top = item, max(item)
            if self.vocab_size and top >= self.vocab_size:
                raise bad_request(f"Token id {top} is out of vocabulary (size "
                                  f"{self.vocab_size})", param="input", code="invalid_value")
        if self.context_length and len(ids) > self.context_length:
            raise prompt_too_long(
                f"This model's maximum context length is {self.context_length} tokens. However, "
                f"an input has {len(ids)} tokens. Please reduce the length of the input.",
                param="input",
            )
        return ids

    # -- native processing ---------------------------------------------------------------------

    def use_native(self, tokenizer: NativeTokenizerLike) -> None:
        """Tokenize with the engine's own tokenizer and chat template from now on, and ask the
        worker for the engine's own detokenization (``output.detokenize``). Parameter
        extraction (sampling, stop, limits) stays ours."""
        self.native = tokenizer

    def native_chat(self, req: ChatCompletionRequest,
                    messages: list[dict[str, Any]] | None = None) -> list[int]:
        """``req``'s prompt by the engine's own template (its ``messages`` as given)."""
        assert self.native is not None
        tools = None
        if req.tools:
            tools = [{"type": t.type, "function": function_dict(t.function)} for t in req.tools]
        messages = messages or [message_dict(m) for m in req.messages]
        kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k not in RESERVED}
        return self._native_call(
            self.native.apply_chat_template, messages, "messages",
            tools=tools, add_generation_prompt=req.add_generation_prompt is not False, **kwargs,
        )

    @staticmethod
    def _native_call(fn: Any, value: Any, param: str, **kwargs: Any) -> list[int]:
        try:
            ids = list(fn(value, **kwargs))
        except Exception as exc:  # the engine's tokenizer or template rejected the input
            raise bad_request(f"The {param} could not be tokenized: {exc}", param=param) from exc
        if not ids:
            raise bad_request(f"The {param} tokenized to nothing", param=param)
        return ids

    # -- shared ---------------------------------------------------------------------------------

    def _encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        tok = self.tokenizer
        try:
            # encode_batch_fast: the same ids as encode at half its cost (no offsets), and it
            # releases the GIL while it works, so a long text tokenized in a thread
            # (_limits.Offload) does not stop the event loop.
            enc = tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
            ids: list[int] = enc.ids
        except Exception as exc:  # tokenizers raises plain exceptions on odd input
            raise bad_request(f"The {param} could not be tokenized: {exc}", param=param) from exc
        if not ids:
            raise bad_request(f"The {param} tokenized to nothing", param=param)
        return ids

    def _logit_bias(self, bias: dict[str, float]) -> dict[int, float]:
        """``logit_bias`` (checked by the protocol) with token ids, each in the vocabulary."""
        out = {int(k): v for k, v in bias.items()}
        top = max(out)
        if self.vocab_size and top >= self.vocab_size:
            raise bad_request(
                f"'logit_bias' names token id {top}, out of vocabulary (size {self.vocab_size})",
                param="logit_bias",
                code="invalid_value",
            )
        return out

    def _build(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        token_ids: list[int],
        max_tokens: int | None,
        max_name: str,
        what: str,
        require: Require | None,
    ) -> PreprocessedRequest:
        guided = constraint(req)
        if guided is not None and require is not None:
            require(Capability.STRUCTURED_OUTPUTS, guided.param)
        n = len(token_ids)
        ctx = self.context_length
        kind = "input messages" if what == "messages" else "input prompt"
        if ctx:
            if n >= ctx:
                raise prompt_too_long(
                    f"This model's maximum context length is {ctx} tokens. However, your request "
                    f"has {n} input tokens. Please reduce the length of the {kind}.",
                    param=what,
                )
            if max_tokens is None:
                max_tokens = ctx - n
            elif n + max_tokens > ctx:
                raise prompt_too_long(
                    f"This model's maximum context length is {ctx} tokens. However, you requested "
                    f"{n + max_tokens} tokens ({n} in the {what}, {max_tokens} in the completion). "
                    f"Please reduce the length of the {what} or completion.",
                    param=max_name,
                )
        min_tokens = req.min_tokens or 0
        if max_tokens is not None and min_tokens > max_tokens:
            raise prompt_too_long(
                f"'min_tokens' ({min_tokens}) exceeds the {max_tokens} tokens left in this "
                f"model's context ({ctx} tokens, {n} in the {what}).",
                param="min_tokens",
            )
        stop = req.stop
        return PreprocessedRequest(
            token_ids=token_ids,
            model=self.model,
            sampling=SamplingOptions(
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                min_p=req.min_p,
                seed=req.seed,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty,
                n=req.n or 1,
                logit_bias=self._logit_bias(req.logit_bias) if req.logit_bias else None,
            ),
            stop=StopConditions(
                max_tokens=max_tokens,
                min_tokens=min_tokens,
                stop=[stop] if isinstance(stop, str) else list(stop or ()),
                stop_token_ids=list(req.stop_token_ids or ()),
                ignore_eos=bool(req.ignore_eos),
                include_stop_str_in_output=bool(req.include_stop_str_in_output),
            ),
            output=OutputOptions(
                logprobs=requested_logprobs(req),
                skip_special_tokens=req.skip_special_tokens is not False,
                detokenize=self.native is not None,
            ),
            eos_token_ids=list(self.eos_token_ids),
            mdcsum=self.card.checksum,
            guided=guided.guided if guided is not None else None,
            priority=req.priority,
        )
