"""Print the raw mDNS records of dynamo-zmq services as one JSON line, then exit:
``python -m tests.support.mdns_browse SECONDS [INSTANCE_HEX...]``.

Browses on every interface (no pinning) until a record of every ``INSTANCE_HEX`` has resolved
or ``SECONDS`` have passed, and prints ``[{"name", "addresses", "port", "ns", "iid"}, ...]``:
every IPv4 address each record carries, not just the one a client would dial.
"""

from __future__ import annotations

import asyncio
import json
import sys

from zeroconf import IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from dynamo_zmq.discovery import SERVICE_TYPE


async def main(seconds: float, wanted: set[str]) -> None:
    aiozc = AsyncZeroconf(ip_version=IPVersion.V4Only)
    names: set[str] = set()
    found: dict[str, dict[str, object]] = {}

    def on_change(
        zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        if state_change is not ServiceStateChange.Removed:
            names.add(name)

    browser = AsyncServiceBrowser(aiozc.zeroconf, SERVICE_TYPE, handlers=[on_change])
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not wanted <= {r["iid"] for r in found.values()} and loop.time() < deadline:
        for name in sorted(names - set(found)):
            info = AsyncServiceInfo(SERVICE_TYPE, name)
            if await info.async_request(aiozc.zeroconf, 1000):
                props = info.decoded_properties
                found[name] = {
                    "name": name,
                    "addresses": info.parsed_addresses(IPVersion.V4Only),
                    "port": info.port,
                    "ns": props.get("ns"),
                    "iid": props.get("iid"),
                }
        await asyncio.sleep(0.1)
    await browser.async_cancel()
    await aiozc.async_close()
    print(json.dumps(sorted(found.values(), key=lambda r: str(r["name"]))), flush=True)


if __name__ == "__main__":
    asyncio.run(main(float(sys.argv[1]), set(sys.argv[2:])))
