"""KV-cache events in vLLM's wire format: the project-wide definition, re-exported for the
mocker."""

from dynamo_zmq.llm import AllBlocksCleared as AllBlocksCleared
from dynamo_zmq.llm import BlockRemoved as BlockRemoved
from dynamo_zmq.llm import BlockStored as BlockStored
from dynamo_zmq.llm import EventBatch as EventBatch
from dynamo_zmq.llm import KvEvent as KvEvent
from dynamo_zmq.llm import encode_batch as encode_batch

__all__ = [
    "AllBlocksCleared", "BlockRemoved", "BlockStored", "EventBatch", "KvEvent", "encode_batch",
]
