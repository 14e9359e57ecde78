"""KV-cache events in vLLM's wire format: the project-wide definition, re-exported for the
mocker."""

from dynamo_zmq.kv_events import AllBlocksCleared as AllBlocksCleared
from dynamo_zmq.kv_events import BlockRemoved as BlockRemoved
from dynamo_zmq.kv_events import BlockStored as BlockStored
from dynamo_zmq.kv_events import EventBatch as EventBatch
from dynamo_zmq.kv_events import KvEvent as KvEvent
from dynamo_zmq.kv_events import encode_batch as encode_batch

__all__ = [
    "AllBlocksCleared", "BlockRemoved", "BlockStored", "EventBatch", "KvEvent", "encode_batch",
]
