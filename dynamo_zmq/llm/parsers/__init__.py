"""Tool-call and reasoning parsers, run by the worker's post-processing.

Each parser is incremental: text deltas in, content, reasoning and OpenAI-style tool-call
deltas out, holding back only text that may still be markup; markup that is invalid or still
open at the end comes back as content, unless a call's name went out (the JSON families send a
call once its name is complete and stream its arguments as written). Families: ``hermes``
(Hermes/Qwen ``<tool_call>``), ``llama3_json``, ``mistral``, ``pythonic``; reasoning:
``deepseek_r1``, ``qwen3``. A worker picks them with ``--tool-call-parser`` /
``--reasoning-parser``, or from its model's chat template (``detect_parsers``).
"""

from ._chain import REASONING_PARSERS as REASONING_PARSERS
from ._chain import TOOL_PARSERS as TOOL_PARSERS
from ._chain import OutputParser as OutputParser
from ._chain import detect_parsers as detect_parsers
from ._chain import output_parser as output_parser
from ._families import HermesToolParser as HermesToolParser
from ._families import Llama3JsonToolParser as Llama3JsonToolParser
from ._families import MistralToolParser as MistralToolParser
from ._families import PythonicToolParser as PythonicToolParser
from ._families import RequiredToolParser as RequiredToolParser
from ._named import NamedToolParser as NamedToolParser
from ._reasoning import DeepSeekR1ReasoningParser as DeepSeekR1ReasoningParser
from ._reasoning import Qwen3ReasoningParser as Qwen3ReasoningParser
from ._reasoning import ReasoningParser as ReasoningParser
from ._tool_base import ToolParser as ToolParser

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "DeepSeekR1ReasoningParser",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "NamedToolParser",
    "OutputParser",
    "PythonicToolParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "RequiredToolParser",
    "ToolParser",
    "detect_parsers",
    "output_parser",
]
