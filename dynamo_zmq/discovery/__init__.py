"""Finding peers: mDNS on the LAN, a static list or a shared directory (or several at once),
behind one ``Discovery`` interface."""

from __future__ import annotations

from ._base import PROTOCOL_VERSION as PROTOCOL_VERSION
from ._base import SERVICE_TYPE as SERVICE_TYPE
from ._base import Advert as Advert
from ._base import Discovery as Discovery
from ._base import DiscoveryEvent as DiscoveryEvent
from ._base import PeerAdded as PeerAdded
from ._base import PeerRemoved as PeerRemoved
from ._combined import CombinedDiscovery as CombinedDiscovery
from ._config import DiscoveryConfig as DiscoveryConfig
from ._config import add_discovery_args as add_discovery_args
from ._config import read_static_file as read_static_file
from ._mdns_addresses import local_networks as local_networks
from ._mdns_addresses import pick_ip as pick_ip
from ._mdns_addresses import reachable_ipv4 as reachable_ipv4
from .directory import DirectoryDiscovery as DirectoryDiscovery
from .mdns import MdnsDiscovery as MdnsDiscovery
from .static import StaticDiscovery as StaticDiscovery

__all__ = [
    "PROTOCOL_VERSION",
    "SERVICE_TYPE",
    "Advert",
    "CombinedDiscovery",
    "DirectoryDiscovery",
    "Discovery",
    "DiscoveryConfig",
    "DiscoveryEvent",
    "MdnsDiscovery",
    "PeerAdded",
    "PeerRemoved",
    "StaticDiscovery",
    "add_discovery_args",
    "local_networks",
    "make_discovery",
    "pick_ip",
    "reachable_ipv4",
    "read_static_file",
]


def make_discovery(cfg: DiscoveryConfig) -> Discovery:
    """Build the backend ``cfg.backend`` names, several combined (not started yet)."""
    made: list[Discovery] = []
    for name in cfg.backends:
        if name == "static":
            made.append(StaticDiscovery(cfg))
        elif name == "dir":
            made.append(DirectoryDiscovery(cfg))
        else:
            made.append(MdnsDiscovery(cfg))
    return made[0] if len(made) == 1 else CombinedDiscovery(made)
