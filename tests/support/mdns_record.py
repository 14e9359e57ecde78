"""Answer mDNS for another instance's advert: ``python -m tests.support.mdns_record NAMESPACE
INSTANCE_HEX ADDRESS COMPONENT [--interface IP] [--ttl SECONDS]``.

Stands in for a responder that still holds a dead instance's record (a cache, a reflector, a
sleep proxy), or for a stray or cloned one claiming a live instance's name. mDNS runs on
``--interface`` (default ``127.0.0.1``: a namespace host passes its own address), and the
records live ``--ttl`` seconds in others' caches (default 120). Prints ``READY <address>
<instance hex>`` once advertising; SIGTERM withdraws (SIGKILL leaves the records to expire).
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from dynamo_zmq.discovery import Advert, DiscoveryConfig, MdnsDiscovery


async def main(args: argparse.Namespace) -> None:
    disc = MdnsDiscovery(DiscoveryConfig(mdns_interfaces=(args.interface,)), ttl=args.ttl)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    advert = Advert(args.namespace, int(args.instance_hex, 16), (args.address,), (args.component,))
    await disc.advertise(advert)
    print(f"READY {args.address} {args.instance_hex}", flush=True)
    await stop.wait()
    await disc.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for name in ("namespace", "instance_hex", "address", "component"):
        parser.add_argument(name)
    parser.add_argument("--interface", default="127.0.0.1")
    parser.add_argument("--ttl", type=int, default=120)
    asyncio.run(main(parser.parse_args()))
