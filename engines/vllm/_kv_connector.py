"""``DynamoZmqConnector``: vLLM's KV-connector interface (v1) for disaggregated prefill and
decode over ZeroMQ, worker to worker, with no service in between.

vLLM loads it by module path (``kv_connector_module_path = "engines.vllm._kv_connector"``,
``kv_connector = "DynamoZmqConnector"``); ``_config.disagg_transfer_config`` builds that config.
The protocol is vLLM's NixlConnector's: a request with ``kv_transfer_params =
{"do_remote_decode": True}`` (a prefill) keeps its blocks when it finishes and returns the
handoff (``remote_host``, ``remote_port``, ``remote_request_id``, ``remote_block_ids``,
``remote_num_tokens``, ``remote_engine_id`` and ``do_remote_prefill: True``); a request with the
handoff (a decode) pulls those blocks into its own before it runs, as if its prompt had been
computed. The scheduler half is ``_kv_scheduler.py``, the worker half (threads, sockets, the
copies) ``_kv_worker.py``.

``kv_connector_extra_config``: ``host`` (advertised in handoffs), ``port``, ``bind`` (the
server's bind host; default ``host``), ``ttl`` (seconds a finished prefill's blocks wait for
their pull; default 60), ``batch_blocks`` (blocks per read; default 16), ``timeout`` (seconds
one read may take; default 10), ``auth_keys`` and ``auth_key_name`` (the worker's
``--auth-keys`` folder and key name: CURVE on both sockets, the prefill engine's public key in
the handoff as ``remote_curve_key``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from dynamo_zmq.transport import CurveAuth

from ._kv_scheduler import SchedulerSide, ZmqConnectorMetadata
from ._kv_worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["DynamoZmqConnector"]

DEFAULT_TTL = 60.0
DEFAULT_BATCH_BLOCKS = 16
DEFAULT_TIMEOUT = 10.0


class DynamoZmqConnector(KVConnectorBase_V1):
    """See the module docstring. One instance per role: the scheduler's and the worker's."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        extra = cfg.kv_connector_extra_config or {}
        host = str(extra.get("host") or "127.0.0.1")
        port = int(extra["port"])
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        # Auth on: the key folder and name (never the keys: vLLM logs its config); the
        # engine-core process loads the keypair from them.
        curve = (CurveAuth(extra["auth_keys"], str(extra["auth_key_name"]))
                 if extra.get("auth_keys") else None)
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(
                str(cfg.engine_id), host, port, vllm_config.cache_config.block_size,
                float(extra.get("ttl", DEFAULT_TTL)),
                curve.public.decode() if curve is not None else None,
            )
        else:
            self._worker = WorkerSide(
                f"{extra.get('bind') or host}:{port}", kv_cache_config.num_blocks,
                int(extra.get("batch_blocks", DEFAULT_BATCH_BLOCKS)),
                float(extra.get("timeout", DEFAULT_TIMEOUT)), curve,
            )
        self._failed: set[str] = set()

    # -- worker role -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert self._worker is not None and isinstance(connector_metadata, ZmqConnectorMetadata)
        self._worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Nothing here: pulls run in the worker side's thread (ordered in ``bind``)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Nothing to save: a prefill's blocks stay in vLLM's cache until pulled."""

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        sent, done, self._failed = self._worker.finished()
        return sent or None, done or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished sends and pulls; a failed pull is ``failed_recving`` (vLLM then recomputes
        the whole prompt locally)."""
        sent, done = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(sent or ()), finished_recving=set(done or ()),
            failed_recving=set(self._failed),
        )

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # -- scheduler role ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)
