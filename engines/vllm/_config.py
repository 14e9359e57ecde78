"""vLLM's engine args from the adapter's settings, and the ``EngineConfig`` a started vLLM
reports."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dynamo_zmq import errors
from dynamo_zmq.llm import EngineConfig, KvHashScheme
from dynamo_zmq.resources import Resources
from dynamo_zmq.transport import current_curve

from ._endpoints import (
    KV_CONNECTOR,
    KV_CONNECTOR_MODULE,
    advertise,
    free_port,
    offset,
    vllm_version,
)
from ._options import STRUCTURED_OUTPUTS_CONFIG, VllmOptions
from ._relay import KvRelay
from ._vision import image_placeholders

__all__ = ["CPU_BLOCK_SIZE", "KV_TOPIC", "build_engine_args", "disagg_transfer_config",
           "engine_arg", "relay_for", "reported_config"]

log = logging.getLogger(__name__)

#: Topic of the KV-event PUB frames (``[topic, seq, payload]``).
KV_TOPIC = "kv-events"
#: Worker roles that transfer KV (``--disaggregation-mode``).
DISAGG_ROLES = ("prefill", "decode")
#: Tokens per KV block on the CPU when not given (vLLM's CPU backend wants multiples of 32).
CPU_BLOCK_SIZE = 32


def engine_arg(given: Any, name: str) -> Any:
    """One of the adapter's engine args (an ``AsyncEngineArgs`` or a dict)."""
    return given.get(name) if isinstance(given, dict) else getattr(given, name, None)


def relay_for(given: Any, opts: VllmOptions, resources: Resources,
              lora_names: Callable[[int], str | None] | None = None) -> KvRelay | None:
    """With KV events on, the relay that republishes vLLM's KV events hashed at the edge, in the
    configured form, and answers full dumps (``_relay.py``; vLLM's own sockets then stay on
    loopback; CURVE with auth on, plaintext without; ``lora_names`` maps vLLM's LoRA ids to
    adapter names, see ``EdgeHasher``). None with KV events off or a
    ``kv_events_config`` of the caller's own (used as given; with auth on, with a warning that
    it is plaintext)."""
    if not opts.kv_events:
        return None
    own = engine_arg(given, "kv_events_config")
    if own is not None:
        if current_curve() is not None:
            log.warning("auth is on but vLLM's own kv_events_config (%s) publishes in plaintext:"
                        " anyone who can reach it reads the KV events", own.endpoint)
        return None
    dp_size = engine_arg(given, "data_parallel_size") or 1
    return KvRelay(resources, dp_size, opts.kv_events_port, opts.kv_replay_port,
                   form=opts.kv_event_form, buffer_size=opts.kv_buffer_steps,
                   lora_names=lora_names)


def build_engine_args(given: Any, opts: VllmOptions, cpu: bool,
                      relay: KvRelay | None = None) -> Any:
    """vLLM's ``AsyncEngineArgs`` from the adapter's engine args (``AsyncEngineArgs`` or a dict)
    and options, with the CPU-friendly defaults and KV events on (free ports where not given;
    the relay's loopback endpoints when there is one).

    Raises:
        InvalidArgument: unknown or invalid engine args, or no model.
    """
    from vllm.config import KVEventsConfig, StructuredOutputsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    if isinstance(given, AsyncEngineArgs):
        kw = {name: getattr(given, name) for name in fields}
    else:
        unknown = sorted(set(given) - fields)
        if unknown:
            raise errors.InvalidArgument(f"unknown vLLM engine args: {', '.join(unknown)}")
        kw = dict(given)
    if not kw.get("model"):
        raise errors.InvalidArgument("the vllm engine needs a model (--model-path)")
    if kw.get("enforce_eager") is None:
        kw["enforce_eager"] = cpu  # torch.compile on a CPU costs minutes at start
    if cpu and kw.get("block_size") is None:
        kw["block_size"] = CPU_BLOCK_SIZE
    world = (kw.get("tensor_parallel_size") or 1) * (kw.get("pipeline_parallel_size") or 1)
    if kw.get("distributed_executor_backend") is None and world == 1:
        kw["distributed_executor_backend"] = "uni"
    if kw.get("structured_outputs_config") is None:
        kw["structured_outputs_config"] = StructuredOutputsConfig(**STRUCTURED_OUTPUTS_CONFIG)
    if kw.get("enable_prefix_caching") is None:
        kw["enable_prefix_caching"] = True
    if opts.disaggregation_mode in DISAGG_ROLES and kw.get("kv_transfer_config") is None:
        sizes = {name: kw.get(name) or 1 for name in
                 ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size")}
        if any(size != 1 for size in sizes.values()):
            # One block server per engine: more ranks would share its port and split the cache.
            raise errors.InvalidArgument(
                f"--disaggregation-mode {opts.disaggregation_mode} with the vllm engine needs one"
                f" rank: {', '.join(f'{k}={v}' for k, v in sizes.items() if v != 1)}"
            )
        kw["kv_transfer_config"] = disagg_transfer_config(opts)
        if kw.get("disable_hybrid_kv_cache_manager") is None:
            kw["disable_hybrid_kv_cache_manager"] = True  # our connector has one KV group
    if opts.kv_events and kw.get("kv_events_config") is None:
        if relay is not None:  # vLLM on loopback, relayed (``_relay.py``)
            endpoint, replay_endpoint = relay.vllm_events, relay.vllm_replay
        else:
            events = opts.kv_events_port or free_port()
            replay = opts.kv_replay_port or free_port(exclude=events)
            # vLLM binds only endpoints with a wildcard ("*"); it connects to any other.
            endpoint, replay_endpoint = f"tcp://*:{events}", f"tcp://*:{replay}"
        kw["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq",
            endpoint=endpoint, replay_endpoint=replay_endpoint,
            buffer_steps=opts.kv_buffer_steps, hwm=100_000, topic=KV_TOPIC,
        )
    try:
        return AsyncEngineArgs(**kw)
    except (ValueError, TypeError) as exc:
        raise errors.InvalidArgument(f"invalid vLLM engine args: {exc}") from exc

def disagg_transfer_config(opts: VllmOptions) -> Any:
    """vLLM's ``KVTransferConfig`` for a prefill or decode worker: our ZeroMQ connector
    (``_kv_connector.py``) by module path, either direction, and a failed pull recomputed
    locally."""
    from vllm.config import KVTransferConfig

    host = opts.advertised_host()
    bind = opts.host if opts.host else host
    extra: dict[str, Any] = {
        "host": host, "bind": "*" if bind in ("0.0.0.0", "*", "") else bind,
        "port": opts.kv_transfer_port or free_port(), "ttl": opts.kv_transfer_ttl,
    }
    curve = current_curve()
    if curve is not None:  # the folder and name only: vLLM logs its config
        extra.update(auth_keys=str(curve.key_dir), auth_key_name=curve.name)
    return KVTransferConfig(
        kv_connector=KV_CONNECTOR,
        kv_connector_module_path=KV_CONNECTOR_MODULE,
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra,
    )


def reported_config(llm: Any, options: VllmOptions, relay: KvRelay | None = None) -> EngineConfig:
    """The ``EngineConfig`` a started ``AsyncLLM`` reports (served name, sizes, KV-event
    endpoints as routers reach them: the relay's sockets when there is one)."""
    cfg = llm.vllm_config
    model, cache, sched, par = (
        cfg.model_config, cfg.cache_config, cfg.scheduler_config, cfg.parallel_config
    )
    # vLLM's served name defaults to the model path; a local directory serves as its name.
    served = model.served_model_name
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    model_id = str(model.model)
    if not served or served == model_id:
        served = Path(model_id).name if Path(model_id).is_dir() else model_id
    events = replay = None
    endpoints: list[str] = []
    kv = cfg.kv_events_config
    lora = getattr(cfg, "lora_config", None)  # None without --enable-lora
    if relay is not None:
        host = options.advertised_host()
        endpoints = [f"tcp://{host}:{port}" for port in relay.events_ports]
        events = endpoints[0]
        replay = f"tcp://{host}:{relay.replay_ports[0]}"
    elif kv is not None and kv.enable_kv_cache_events and kv.publisher == "zmq":
        host = options.advertised_host()
        events = advertise(kv.endpoint, host)
        replay = advertise(kv.replay_endpoint, host) if kv.replay_endpoint else None
        # vLLM offsets the ports of data-parallel rank r by r.
        endpoints = (
            [offset(events, r) for r in range(par.data_parallel_size)] if events else []
        )
    image_token_id, tokens_per_image = image_placeholders(model) or (None, 0)
    return EngineConfig(
        model_name=model_id,
        served_model_name=served,
        context_length=int(model.max_model_len),
        kv_block_size=int(cache.block_size),
        total_kv_blocks=int(cache.num_gpu_blocks or 0),
        max_num_seqs=int(sched.max_num_seqs),
        max_num_batched_tokens=int(sched.max_num_batched_tokens),
        data_parallel_size=int(par.data_parallel_size),
        data_parallel_start_rank=int(getattr(par, "data_parallel_rank", 0) or 0),
        kv_events_endpoint=events,
        kv_replay_endpoint=replay,
        # The relay hashes at the edge (``_edge.py``); vLLM's own publisher does not.
        kv_hash_scheme=(KvHashScheme.ours(int(cache.block_size), relay.form)
                        if relay is not None else None),
        extra={
            "engine": "vllm",
            "vllm_version": vllm_version(),
            "native_processing": options.native_processing,
            # The frontend's tokenizer for native processing: a dynamo_zmq.tokenizers plugin.
            "native_tokenizer": "vllm",
            "enable_prefix_caching": bool(cache.enable_prefix_caching),
            "kv_events_topic": kv.topic if kv is not None else None,
            "kv_events_format": "vllm",
            "kv_events_endpoints": endpoints,
            "model_path": str(model.model),
            # The adapters resident per engine core (the KV router's residency prediction).
            **({"max_loras": int(lora.max_loras)} if lora is not None else {}),
        },
        image_token_id=image_token_id,
        tokens_per_image=tokens_per_image,
    )
