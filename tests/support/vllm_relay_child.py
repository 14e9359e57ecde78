"""A process with auth on whose KV events come from vLLM's own ``ZmqEventPublisher`` through
``engines.vllm._relay.KvRelay``, as a vLLM worker's do: ``python -m tests.support.vllm_relay_child
KEYDIR NAME OUT.json [FORM]`` (KEYDIR ``-``: auth off; FORM: the relay's ``--kv-event-form``).
Writes the endpoints to OUT.json, prints READY, publishes a batch every 0.1 s until stopped:
batch i stores root block i + 1 of tokens [1, 2] (so one own hash for all of them)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from dynamo_zmq.resources import Resources, process_zmq_context
from dynamo_zmq.transport import enable_curve
from engines.vllm._relay import KvRelay


async def main(key_dir: str, name: str, out: str, form: str = "stores") -> None:
    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

    if key_dir != "-":
        enable_curve(key_dir, name, process_zmq_context())
    res = Resources("relay-child")
    relay = KvRelay(res, dp_size=1, form=form)
    relay.start()
    publisher = ZmqEventPublisher(0, endpoint=relay.vllm_events,
                                  replay_endpoint=relay.vllm_replay, topic="kv-events")
    ports = {"pub": relay.events_ports[0], "replay": relay.replay_ports[0],
             "vllm_events": relay.vllm_events, "vllm_replay": relay.vllm_replay}
    await asyncio.to_thread(Path(out).write_text, json.dumps(ports))
    print(f"READY tcp://127.0.0.1:{relay.events_ports[0]} 1", flush=True)
    # vLLM's PUB connects to the relay's SUB: a batch sent before that is done is lost to the
    # relay (a real engine publishes only once requests run, long after).
    await asyncio.sleep(0.5)
    try:
        for i in range(100_000):
            stored = BlockStored(block_hashes=[i + 1], parent_block_hash=None, token_ids=[1, 2],
                                 block_size=2, lora_id=None, medium=None, lora_name=None)
            publisher.publish(KVEventBatch(ts=time.time(), events=[stored]))
            await asyncio.sleep(0.1)
    finally:
        publisher.shutdown()
        await res.close()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
