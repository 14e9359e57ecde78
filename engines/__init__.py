"""Engine adapters, each a plugin the worker finds by entry point (``dynamo_zmq.engines``):
``engines.mocker`` (simulated vLLM on the CPU) and ``engines.vllm``. Import the one you need;
this package imports none of them."""

__all__: list[str] = []
