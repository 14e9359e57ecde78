"""``KvTransfer``: what a worker hands its engine for disaggregated serving."""

from __future__ import annotations

from dataclasses import dataclass

from ._client import KvTransferClient
from ._server import KvTransferServer

__all__ = ["KvTransfer"]


@dataclass(frozen=True)
class KvTransfer:
    """The worker's role and its transfer ends: a prefill worker has a started ``server``
    (its engine offers KV there), a decode worker a ``client`` (its engine pulls with it)."""

    role: str
    server: KvTransferServer | None = None
    client: KvTransferClient | None = None
