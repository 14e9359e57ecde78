"""A runtime-API client doing one disaggregated request and its aggregated reference, in a
process of its own (CURVE, once on, is on for the whole process):
``python -m tests.support.disagg_client PREFILL_NS DECODE_NS KEY_DIR KEY_NAME PROMPT_JSON N``.

Sends the prompt aggregated to the prefill worker (greedy, N tokens), then with
``disaggregation = DecodeRemotely`` and max_tokens 1 to it, then with ``PrefillRemotely`` and
the handoff to the decode worker; prints ``{"reference", "tokens", "handoff"}`` as JSON.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from dynamo_zmq.discovery import DiscoveryConfig
from dynamo_zmq.runtime import DistributedRuntime, RuntimeConfig


async def _run(client: Any, prompt: list[int], n: int, disagg: dict | None) -> tuple[list, dict]:
    req = {"token_ids": prompt, "sampling": {"temperature": 0.0},
           "stop": {"max_tokens": n, "ignore_eos": True}, "disaggregation": disagg}
    got = [item.data() async for item in await client.generate(req)]
    return [t for out in got for t in out.get("token_ids") or []], got[-1]


async def main(pns: str, dns: str, keys: str, name: str, prompt: list[int], n: int) -> None:
    disc = DiscoveryConfig(backend="mdns", mdns_interfaces=("127.0.0.1",))
    config = RuntimeConfig(discovery=disc, host="127.0.0.1", auth_keys=keys, auth_key_name=name)
    async with DistributedRuntime(config=config) as rt:
        clients = []
        for ns in (pns, dns):
            client = await rt.endpoint(f"{ns}.backend.generate").client()
            await client.wait_for_instances()
            clients.append(client)
        reference, _ = await _run(clients[0], prompt, n, None)
        _, terminal = await _run(clients[0], prompt, 1, {"type": "decode_remotely"})
        handoff = terminal.get("kv_handoff")
        tokens, _ = await _run(clients[1], prompt, n,
                               {"type": "prefill_remotely", "handoff": handoff})
    print(json.dumps({"reference": reference, "tokens": tokens, "handoff": handoff}), flush=True)


if __name__ == "__main__":
    a = sys.argv[1:]
    asyncio.run(asyncio.wait_for(main(a[0], a[1], a[2], a[3], json.loads(a[4]), int(a[5])), 300))
