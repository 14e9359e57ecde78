"""The runtime: ``DistributedRuntime -> Namespace -> Component -> Endpoint``, clients, peers.

A Dynamo Python worker ports by changing its import::

    from dynamo_zmq.runtime import DistributedRuntime, dynamo_worker, dynamo_endpoint, Context

One ROUTER socket per process serves every endpoint; calls go peer to peer over one DEALER per
remote process. Discovery (mDNS or a static list) and liveness replace etcd and NATS. This layer
sits on the transport and discovery layers and knows nothing of LLMs.
"""

from ..context import Context as Context
from ._cli import check_number as check_number
from ._cli import run_main as run_main
from ._cli import setup_logging as setup_logging
from ._client import Client as Client
from ._client import RouterMode as RouterMode
from ._config import RuntimeConfig as RuntimeConfig
from ._config import add_auth_args as add_auth_args
from ._config import add_runtime_args as add_runtime_args
from ._config import auth_from_args as auth_from_args
from ._decorators import dynamo_endpoint as dynamo_endpoint
from ._decorators import dynamo_worker as dynamo_worker
from ._lease import Lease as Lease
from ._naming import Component as Component
from ._naming import Endpoint as Endpoint
from ._naming import Namespace as Namespace
from ._naming import check_name as check_name
from ._peers import PeerPool as PeerPool
from ._retry import MAX_ATTEMPTS as MAX_ATTEMPTS
from ._retry import failover as failover
from ._runtime import DistributedRuntime as DistributedRuntime
from ._status_server import StatusServer as StatusServer
from ._status_server import system_port_from_env as system_port_from_env

__all__ = [
    "MAX_ATTEMPTS",
    "Client",
    "Component",
    "Context",
    "DistributedRuntime",
    "Endpoint",
    "Lease",
    "Namespace",
    "PeerPool",
    "RouterMode",
    "RuntimeConfig",
    "StatusServer",
    "add_auth_args",
    "add_runtime_args",
    "auth_from_args",
    "check_name",
    "check_number",
    "dynamo_endpoint",
    "dynamo_worker",
    "failover",
    "run_main",
    "setup_logging",
    "system_port_from_env",
]
