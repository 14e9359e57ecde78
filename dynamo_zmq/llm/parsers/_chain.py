"""The parsers by name, the model-card fallback, and ``OutputParser``: a request's reasoning
and tool-call parsing over the worker's post-processed chunks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .._messages import FinishReason, LLMEngineOutput, PreprocessedRequest
from ._families import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    PythonicToolParser,
    RequiredToolParser,
)
from ._named import NamedToolParser
from ._reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser, ReasoningParser
from ._tool_base import ToolParser

__all__ = ["REASONING_PARSERS", "TOOL_PARSERS", "OutputParser", "detect_parsers", "output_parser"]

#: ``--tool-call-parser`` names (vLLM's names for the same formats).
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls
    for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}
#: ``--reasoning-parser`` names.
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}

#: Markup in a chat template -> the tool-call parser for it.
_TOOL_HINTS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"),
               ("<|python_tag|>", "llama3_json"))
_ENDS = frozenset({FinishReason.STOP, FinishReason.EOS})


def _template_text(model_dir: Path) -> str:
    texts: list[str] = []
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        texts.append(jinja.read_text(encoding="utf-8", errors="replace"))
    try:
        config: Any = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, str):
        texts.append(template)
    elif isinstance(template, list):
        texts.extend(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return "\n".join(texts)


def detect_parsers(model_dir: str | Path) -> tuple[str | None, str | None]:
    """``(tool-call parser, reasoning parser)`` a model's chat template implies (the fallback
    when the worker is given none): ``<tool_call>`` -> hermes, ``[TOOL_CALLS]`` -> mistral,
    ``<|python_tag|>`` -> llama3_json; ``</think>`` -> deepseek_r1 in a DeepSeek template,
    else qwen3. None where nothing matches."""
    text = _template_text(Path(model_dir))
    tool = next((name for hint, name in _TOOL_HINTS if hint in text), None)
    reasoning = None
    if "</think>" in text:
        reasoning = "deepseek_r1" if "deepseek" in text.lower() else "qwen3"
    return tool, reasoning


class OutputParser:
    """Reasoning first, then tool calls on the content: ``apply`` rewrites each chunk's text
    into ``reasoning``, content ``text`` and ``tool_calls``; a terminal flushes both parsers,
    and an ``eos``/``stop`` terminal after a tool call becomes ``tool_calls``. With ``single``
    (``parallel_tool_calls: false``) only the first call goes out: later calls' deltas are
    dropped. ``replay`` brings both parsers to where a lost worker's were (a migrated request's
    output already streamed), emitting nothing."""

    __slots__ = ("reasoning", "single", "tools")

    def __init__(
        self, tools: ToolParser | None, reasoning: ReasoningParser | None, single: bool = False
    ) -> None:
        self.tools = tools
        self.reasoning = reasoning
        self.single = single

    def replay(self, text: str) -> None:
        """Feed ``text`` (output the client already has) and drop what comes out."""
        if self.reasoning is not None:
            text = self.reasoning.feed(text)[1]
        if self.tools is not None:
            self.tools.feed(text)

    def apply(self, out: LLMEngineOutput) -> LLMEngineOutput:
        text = out.text or ""
        final = out.finish_reason is not None
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text)
            if final:
                more, rest = self.reasoning.finish()
                thought, text = thought + more, text + rest
            out.reasoning = thought or None
        if self.tools is not None:
            text, calls = self.tools.feed(text)
            if final:
                rest, more_calls = self.tools.finish()
                text, calls = text + rest, calls + more_calls
                if self.tools.calls and out.finish_reason in _ENDS:
                    out.finish_reason = FinishReason.TOOL_CALLS
            if self.single:
                calls = [c for c in calls if c.index == 0]
            out.tool_calls = calls or None
        out.text = text
        return out


def output_parser(
    request: PreprocessedRequest, tool_parser: str | None, reasoning_parser: str | None,
    id_seed: str = "",
) -> OutputParser | None:
    """The parsing ``request`` needs on a worker configured with these parser names; None
    when it needs none (no tools or ``tool_choice: none``, and no reasoning parser). Tool call
    ids derive from ``id_seed`` (the request's id; "": random, see ``new_call_id``)."""
    tools: ToolParser | None = None
    options = request.tools
    constrained = False  # the output is the constrained JSON from its first token: no reasoning
    if options is not None:
        if options.choice == "required":
            tools, constrained = RequiredToolParser(), True
        elif options.choice == "function" and options.function:
            tools, constrained = NamedToolParser(options.function), True
        elif tool_parser is not None:
            tools = TOOL_PARSERS[tool_parser]()
    reasoning = None
    if request.reasoning and reasoning_parser is not None and not constrained:
        reasoning = REASONING_PARSERS[reasoning_parser]()
    if tools is None and reasoning is None:
        return None
    if tools is not None:
        tools.id_seed = id_seed
    single = options is not None and options.choice == "auto" and not options.parallel
    return OutputParser(tools, reasoning, single)
