"""ZMQ sockets of the request plane: the ROUTER server and the per-peer DEALER connection."""

from ._sockets import AsyncSocket as AsyncSocket
from ._sockets import SendResult as SendResult
from ._sockets import make_socket as make_socket
from .client import PeerConnection as PeerConnection
from .client import PeerState as PeerState
from .client import Response as Response
from .client import ResponseStream as ResponseStream
from .server import Handler as Handler
from .server import Server as Server

__all__ = [
    "AsyncSocket",
    "Handler",
    "PeerConnection",
    "PeerState",
    "Response",
    "ResponseStream",
    "SendResult",
    "Server",
    "make_socket",
]
