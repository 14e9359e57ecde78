"""``KvTransferConfig``: the transfer server's and client's settings, and their worker flags."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgument

__all__ = ["KvTransferConfig", "add_kv_transfer_args"]


@dataclass(frozen=True)
class KvTransferConfig:
    """How a worker serves and pulls KV transfers (``--kv-transfer-*`` flags).

    Raises:
        InvalidArgument: a value out of range.
    """

    #: Port of the prefill worker's transfer ROUTER (0 = any).
    port: int = 0
    #: Bytes held for offered transfers not yet pulled; an offer beyond it is refused.
    max_bytes: int = 8 << 30
    #: Seconds an offered transfer waits for its pull (and a pull may stall) before it expires.
    ttl: float = 30.0
    #: Blocks per batch message.
    batch_blocks: int = 16
    #: Batches a client lets the server have in flight (its credit).
    credit: int = 4
    #: Seconds a pull waits for the server's next message before it gives up.
    timeout: float = 5.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidArgument(f"--kv-transfer-port {self.port} out of range")
        for name in ("max_bytes", "batch_blocks", "credit"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"kv transfer {name} must be >= 1, got {getattr(self, name)}")
        if self.credit > 1024:
            raise InvalidArgument(f"--kv-transfer-credit must be <= 1024, got {self.credit}")
        for name in ("ttl", "timeout"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"kv transfer {name} must be > 0, got {getattr(self, name)}")

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> KvTransferConfig:
        """The settings in parsed flags (defaults for those missing)."""
        def get(name: str, default: Any) -> Any:
            value = getattr(args, f"kv_transfer_{name}", None)
            return default if value is None else value

        d = cls()
        return cls(
            port=int(get("port", d.port)), max_bytes=int(get("max_bytes", d.max_bytes)),
            ttl=float(get("ttl", d.ttl)), batch_blocks=int(get("batch_blocks", d.batch_blocks)),
            credit=int(get("credit", d.credit)), timeout=float(get("timeout", d.timeout)),
        )


def add_kv_transfer_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add the ``--kv-transfer-*`` flags (worker flags: engine-agnostic), each defaulting to its
    ``DYN_*`` variable (``--kv-transfer-port`` -> ``DYN_KV_TRANSFER_PORT``)."""
    d = KvTransferConfig()
    env = os.environ.get
    add = parser.add_argument
    add("--kv-transfer-port", type=int, default=env("DYN_KV_TRANSFER_PORT", d.port),
        help="port of the KV transfer socket of a prefill worker (0 = any) "
             "[DYN_KV_TRANSFER_PORT]")
    add("--kv-transfer-max-bytes", type=int, default=env("DYN_KV_TRANSFER_MAX_BYTES", d.max_bytes),
        help="bytes of KV a prefill worker holds for transfers not yet pulled; an offer "
             "beyond it is refused and the decode worker prefills locally (default 8 GiB) "
             "[DYN_KV_TRANSFER_MAX_BYTES]")
    add("--kv-transfer-ttl", type=float, default=env("DYN_KV_TRANSFER_TTL", d.ttl),
        help="seconds an offered KV transfer waits for its pull before it expires "
             "[DYN_KV_TRANSFER_TTL]")
    add("--kv-transfer-batch-blocks", type=int,
        default=env("DYN_KV_TRANSFER_BATCH_BLOCKS", d.batch_blocks),
        help="KV blocks per transfer message [DYN_KV_TRANSFER_BATCH_BLOCKS]")
    add("--kv-transfer-credit", type=int, default=env("DYN_KV_TRANSFER_CREDIT", d.credit),
        help="transfer messages a decode worker lets the prefill worker have in flight "
             "[DYN_KV_TRANSFER_CREDIT]")
    add("--kv-transfer-timeout", type=float, default=env("DYN_KV_TRANSFER_TIMEOUT", d.timeout),
        help="seconds a decode worker waits for the next transfer message before it gives up "
             "and prefills locally [DYN_KV_TRANSFER_TIMEOUT]")
