"""The OpenAI-compatible HTTP frontend (``python -m dynamo_zmq.frontend``): request parsing and
validation, preprocessing (chat template, tokens), the model table learned from the workers,
and the ASGI app that streams each request's outputs as SSE."""

from .app import FrontendApp as FrontendApp
from .errors import HttpError as HttpError
from .metrics import FrontendMetrics as FrontendMetrics
from .models import ModelEntry as ModelEntry
from .models import ModelManager as ModelManager
from .preprocess import Preprocessor as Preprocessor
from .protocol import ChatCompletionRequest as ChatCompletionRequest
from .protocol import CompletionRequest as CompletionRequest
from .protocol import parse_chat as parse_chat
from .protocol import parse_completion as parse_completion

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "FrontendApp",
    "FrontendMetrics",
    "HttpError",
    "ModelEntry",
    "ModelManager",
    "Preprocessor",
    "parse_chat",
    "parse_completion",
]
