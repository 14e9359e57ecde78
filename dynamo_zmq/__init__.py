"""dynamo-zmq: Dynamo-style distributed LLM serving on ZeroMQ, MessagePack and mDNS."""

__version__ = "0.1.0"
