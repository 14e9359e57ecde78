"""ZMQ sockets of the request plane: the ROUTER server and the per-peer DEALER connection."""

from ._bad_input import BadInput as BadInput
from ._bad_input import bad_input_totals as bad_input_totals
from ._curve import CurveAuth as CurveAuth
from ._curve import CurveRefused as CurveRefused
from ._curve import current_curve as current_curve
from ._curve import disable_curve as disable_curve
from ._curve import enable_curve as enable_curve
from ._curve import peer_key as peer_key
from ._curve import peer_roles as peer_roles
from ._curve import warn_unless_own_role as warn_unless_own_role
from ._items import ItemDecoder as ItemDecoder
from ._items import Response as Response
from ._items import item_decoder as item_decoder
from ._items import plain_items as plain_items
from ._items import response_items as response_items
from ._key_roles import DEFAULT_CALLERS as DEFAULT_CALLERS
from ._key_roles import EVERY_ROLE as EVERY_ROLE
from ._key_roles import KEY_ROLES as KEY_ROLES
from ._key_roles import SERVING as SERVING
from ._key_roles import WORKER as WORKER
from ._key_roles import WORKER_CALLERS as WORKER_CALLERS
from ._key_roles import Domain as Domain
from ._key_roles import format_roles as format_roles
from ._key_roles import parse_roles as parse_roles
from ._peer_liveness import PingTicker as PingTicker
from ._reach import endpoint_via as endpoint_via
from ._sockets import AsyncSocket as AsyncSocket
from ._sockets import SendResult as SendResult
from ._sockets import make_socket as make_socket
from ._sockets import set_connect_options as set_connect_options
from ._streams import ItemStream as ItemStream
from ._streams import Reopen as Reopen
from ._streams import ResponseStream as ResponseStream
from ._streams import StreamHost as StreamHost
from .client import DEFAULT_WINDOW as DEFAULT_WINDOW
from .client import PeerConnection as PeerConnection
from .client import PeerState as PeerState
from .server import Handler as Handler
from .server import Server as Server

__all__ = [
    "DEFAULT_CALLERS",
    "DEFAULT_WINDOW",
    "EVERY_ROLE",
    "KEY_ROLES",
    "SERVING",
    "WORKER",
    "WORKER_CALLERS",
    "AsyncSocket",
    "BadInput",
    "CurveAuth",
    "CurveRefused",
    "Domain",
    "Handler",
    "ItemDecoder",
    "ItemStream",
    "PeerConnection",
    "PeerState",
    "PingTicker",
    "Reopen",
    "Response",
    "ResponseStream",
    "SendResult",
    "Server",
    "StreamHost",
    "bad_input_totals",
    "current_curve",
    "disable_curve",
    "enable_curve",
    "endpoint_via",
    "format_roles",
    "item_decoder",
    "make_socket",
    "parse_roles",
    "peer_key",
    "peer_roles",
    "plain_items",
    "response_items",
    "set_connect_options",
    "warn_unless_own_role",
]
