"""The mocker engine: simulated vLLM on the CPU (``--engine mocker``).

It batches, chunks prefills, preempts, caches prefixes and publishes vLLM-format KV events like
the real engine, samples random tokens, and sleeps for Dynamo's mocker step-time model.
"""

from ._config import MockerConfig as MockerConfig
from ._engine import MockerEngine as MockerEngine

__all__ = ["MockerConfig", "MockerEngine"]
