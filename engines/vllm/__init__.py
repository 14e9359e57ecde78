"""The vLLM engine adapter (``--engine vllm``): vLLM v1's ``AsyncLLM`` behind a dynamo-zmq worker.

vLLM is imported only when an engine starts (or its flags are built), so this package imports
without vLLM installed; using it then fails with ``InvalidArgument`` naming the ``vllm`` extra.
"""

from ._engine import VllmEngine as VllmEngine
from ._options import VllmOptions as VllmOptions

__all__ = ["VllmEngine", "VllmOptions"]
