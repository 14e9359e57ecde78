"""Brokerless KV transfer between workers: a prefill worker's ``KvTransferServer`` holds the KV
blocks of a prompt for one pull; the decode worker's ``KvTransferClient`` pulls them over ZeroMQ
in batches with credit-based flow control (docs/disaggregation.md; the messages: docs/wire.md).
"""

from ._client import KvTransferClient as KvTransferClient
from ._config import KvTransferConfig as KvTransferConfig
from ._config import add_kv_transfer_args as add_kv_transfer_args
from ._errors import TransferFailed as TransferFailed
from ._errors import TransferFull as TransferFull
from ._errors import TransferNotFound as TransferNotFound
from ._messages import Ack as Ack
from ._messages import Batch as Batch
from ._messages import Failure as Failure
from ._messages import Pull as Pull
from ._messages import Release as Release
from ._messages import Ticket as Ticket
from ._messages import decode_client as decode_client
from ._messages import decode_server as decode_server
from ._messages import encode as encode
from ._metrics import KvTransferMetrics as KvTransferMetrics
from ._server import KvTransferServer as KvTransferServer
from ._server import OnRelease as OnRelease
from ._transfer import KvTransfer as KvTransfer

__all__ = [
    "Ack",
    "Batch",
    "Failure",
    "KvTransfer",
    "KvTransferClient",
    "KvTransferConfig",
    "KvTransferMetrics",
    "KvTransferServer",
    "OnRelease",
    "Pull",
    "Release",
    "Ticket",
    "TransferFailed",
    "TransferFull",
    "TransferNotFound",
    "add_kv_transfer_args",
    "decode_client",
    "decode_server",
    "encode",
]
