"""The worker's part in disaggregated serving: check the engine can, and give it its KV-transfer
ends (``dynamo_zmq.kv_transfer``). A prefill worker binds its transfer server at start; a decode
worker only gets a client (one connection per pull, to the endpoint in the handoff)."""

from __future__ import annotations

import logging

from .. import errors
from ..kv_transfer import KvTransfer, KvTransferClient, KvTransferMetrics, KvTransferServer
from ..llm import Capability, LLMEngine
from ..resources import Resources
from ..runtime import RuntimeConfig
from ._config import WorkerConfig
from ._metrics import METRIC_LABELS, WorkerMetrics

__all__ = ["start_kv_transfer"]

log = logging.getLogger("dynamo_zmq.worker")


async def start_kv_transfer(engine: LLMEngine, settings: WorkerConfig, rc: RuntimeConfig,
                            metrics: WorkerMetrics, res: Resources) -> KvTransfer | None:
    """Set ``engine.kv_transfer`` for a ``prefill`` or ``decode`` worker (None for ``agg``, and
    for an engine with ``Capability.OWN_KV_TRANSFER``).
    The server, if any, closes with ``res``.

    Raises:
        InvalidArgument: the engine lacks ``Capability.DISAGGREGATION``.
    """
    role = settings.disaggregation_mode
    if role == "agg":
        return None
    if Capability.DISAGGREGATION not in engine.capabilities():
        raise errors.InvalidArgument(
            f"--disaggregation-mode {role}: the {engine.name or type(engine).__name__} engine "
            "does not support disaggregated serving"
        )
    if Capability.OWN_KV_TRANSFER in engine.capabilities():
        return None  # the engine's own transfer (e.g. vLLM's KV connector) moves the KV
    cfg = settings.kv_transfer
    labels = dict(zip(METRIC_LABELS, metrics.labels, strict=True))
    tm = KvTransferMetrics(metrics.registry, labels)
    if role == "decode":
        engine.kv_transfer = transfer = KvTransfer(role, client=KvTransferClient(cfg, tm))
        return transfer
    hosts = rc.advertised_hosts()
    server = KvTransferServer(cfg, bind_host=rc.bind_host, advertise_host=hosts[0], hosts=hosts,
                              metrics=tm)
    res.on_close(server.close)
    await server.start()
    engine.kv_transfer = transfer = KvTransfer(role, server=server)
    log.info("prefill worker: KV transfers served on %s", server.endpoint)
    return transfer
