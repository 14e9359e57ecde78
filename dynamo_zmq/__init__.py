"""dynamo-zmq: Dynamo-style distributed LLM serving on ZeroMQ, MessagePack and mDNS.

What a program built on it imports most, from the layers below (each layer's package has the
rest): the runtime API a Dynamo worker ports to (``dynamo_zmq.runtime``), the cancellation
``Context``, the error types (``dynamo_zmq.errors``) and the engine contract
(``dynamo_zmq.llm``)::

    from dynamo_zmq import DistributedRuntime, dynamo_worker, Context, LLMEngine
"""

from . import errors as errors
from .context import Context as Context
from .errors import DynamoError as DynamoError
from .llm import EngineConfig as EngineConfig
from .llm import FinishReason as FinishReason
from .llm import LLMEngine as LLMEngine
from .llm import LLMEngineOutput as LLMEngineOutput
from .llm import PreprocessedRequest as PreprocessedRequest
from .runtime import Client as Client
from .runtime import Component as Component
from .runtime import DistributedRuntime as DistributedRuntime
from .runtime import Endpoint as Endpoint
from .runtime import Namespace as Namespace
from .runtime import RouterMode as RouterMode
from .runtime import dynamo_endpoint as dynamo_endpoint
from .runtime import dynamo_worker as dynamo_worker

__version__ = "0.1.0"

__all__ = [
    "Client",
    "Component",
    "Context",
    "DistributedRuntime",
    "DynamoError",
    "Endpoint",
    "EngineConfig",
    "FinishReason",
    "LLMEngine",
    "LLMEngineOutput",
    "Namespace",
    "PreprocessedRequest",
    "RouterMode",
    "dynamo_endpoint",
    "dynamo_worker",
    "errors",
]
