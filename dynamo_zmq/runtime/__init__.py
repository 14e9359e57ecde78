"""The runtime: ``DistributedRuntime -> Namespace -> Component -> Endpoint``, clients, peers.

A Dynamo Python worker ports by changing its import to ``dynamo_zmq.runtime``; see
``DistributedRuntime``. Everything here sits on the transport and discovery layers.
"""

from ._cli import check_number as check_number
from ._cli import setup_logging as setup_logging
from ._client import Client as Client
from ._client import FailoverStream as FailoverStream
from ._client import RouterMode as RouterMode
from ._config import RuntimeConfig as RuntimeConfig
from ._config import add_runtime_args as add_runtime_args
from ._peers import PeerPool as PeerPool
from ._retry import MAX_ATTEMPTS as MAX_ATTEMPTS
from ._retry import RetryingStream as RetryingStream
from ._runtime import Component as Component
from ._runtime import Context as Context
from ._runtime import DistributedRuntime as DistributedRuntime
from ._runtime import Endpoint as Endpoint
from ._runtime import Namespace as Namespace
from ._runtime import check_name as check_name
from ._runtime import dynamo_endpoint as dynamo_endpoint
from ._runtime import dynamo_worker as dynamo_worker
from ._status_server import StatusServer as StatusServer

__all__ = [
    "MAX_ATTEMPTS",
    "Client",
    "Component",
    "Context",
    "DistributedRuntime",
    "Endpoint",
    "FailoverStream",
    "Namespace",
    "PeerPool",
    "RetryingStream",
    "RouterMode",
    "RuntimeConfig",
    "StatusServer",
    "add_runtime_args",
    "check_name",
    "check_number",
    "dynamo_endpoint",
    "dynamo_worker",
    "setup_logging",
]
