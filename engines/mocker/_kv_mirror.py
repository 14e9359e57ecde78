"""``KvStateMirror`` (now shared with the vLLM relay: ``dynamo_zmq.llm._kv_mirror``)."""

from dynamo_zmq.llm._kv_mirror import SNAPSHOT_BLOCKS as SNAPSHOT_BLOCKS
from dynamo_zmq.llm._kv_mirror import KvStateMirror as KvStateMirror

__all__ = ["SNAPSHOT_BLOCKS", "KvStateMirror"]
