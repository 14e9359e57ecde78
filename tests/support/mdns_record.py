"""Answer mDNS for another instance's advert: ``python -m tests.support.mdns_record NAMESPACE
INSTANCE_HEX ADDRESS COMPONENT``.

Stands in for a responder that still holds a dead instance's record (a cache, a reflector, a
sleep proxy). Prints ``READY <address> <instance hex>`` once advertising; SIGTERM withdraws.
"""

from __future__ import annotations

import asyncio
import signal
import sys

from dynamo_zmq.discovery import Advert, DiscoveryConfig, MdnsDiscovery


async def main(namespace: str, instance_hex: str, address: str, component: str) -> None:
    disc = MdnsDiscovery(DiscoveryConfig(mdns_interfaces=("127.0.0.1",)))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await disc.advertise(Advert(namespace, int(instance_hex, 16), (address,), (component,)))
    print(f"READY {address} {instance_hex}", flush=True)
    await stop.wait()
    await disc.close()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
