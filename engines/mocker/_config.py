"""The mocker's settings: one dataclass, its command-line flags (Dynamo's mocker names), and the
few fields read from a model directory (``config.json`` / ``generation_config.json``)."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynamo_zmq.errors import InvalidArgument
from dynamo_zmq.llm._block_hashing import FORM_DELTAS
from dynamo_zmq.llm._kv_forms import KV_EVENT_FORMS

from ._lora import parse_lora_modules
from ._waiting import POLICIES

__all__ = ["MockerConfig", "add_mocker_args", "config_from_args", "read_model_dir"]

DEFAULT_CONTEXT_LENGTH = 8192
DEFAULT_VOCAB_SIZE = 32000
_WILDCARDS = ("0.0.0.0", "*", "")


@dataclass(frozen=True)
class MockerConfig:
    """Everything the mocker needs; ``from_args`` fills it from flags and the model directory."""

    model_name: str = "mocker"
    model_path: str | None = None
    vocab_size: int = DEFAULT_VOCAB_SIZE
    context_length: int = DEFAULT_CONTEXT_LENGTH
    #: End-of-sequence ids of the model (added to each request's own ``eos_token_ids``).
    eos_token_ids: tuple[int, ...] = ()
    block_size: int = 64
    #: KV blocks per data-parallel rank.
    num_gpu_blocks: int = 16384
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    speedup_ratio: float = 1.0
    #: > 0: prefill costs this many ms per uncached token (before ``speedup_ratio``) instead of
    #: Dynamo's fit, whose fixed 16.5 ms a step hides what a prefix hit saves.
    prefill_ms_per_token: float = 0.0
    data_parallel_size: int = 1
    enable_prefix_caching: bool = True
    #: Base seed of the token generator (a request's ``sampling.seed`` replaces it).
    seed: int = 0
    enable_kv_events: bool = True
    kv_events_port: int = 0
    kv_replay_port: int = 0
    #: Published batches kept for replay.
    replay_buffer_size: int = 10_000
    #: Bind host of the KV-event sockets; None or a wildcard binds every interface.
    host: str | None = None
    #: Address advertised for the KV-event sockets (default: see ``advertised_host``).
    advertise: str | None = None
    #: Dimensions of the mocker's deterministic embeddings (``/v1/embeddings``); 0: it
    #: cannot embed.
    embedding_dim: int = 0
    #: Bytes of KV cache one token takes (the transfer size a disaggregated request models;
    #: default: Llama-3-8B in bf16, 2 x 32 layers x 8 KV heads x 128 dims x 2 bytes).
    kv_bytes_per_token: int = 131072
    #: Modeled KV transfer bandwidth between a prefill and a decode worker, in GB/s.
    kv_transfer_bandwidth: float = 25.0
    #: Root seed of the router hashes the mocker publishes with its blocks (None: the router's
    #: own, ``ROOT_SEED``). Another one is advertised as such: routers then hash the tokens.
    kv_hash_seed: int | None = None
    #: What the KV-event payloads are (``KvHashScheme.form``): "stores" (vLLM's events with the
    #: router's own hashes) or "deltas" (own-hash deltas, ``OwnBatch``).
    kv_event_form: str = FORM_DELTAS
    #: The waiting queue's order (vLLM's ``--scheduling-policy``): "fcfs" (arrival) or
    #: "priority" (``PreprocessedRequest.priority``, lower first, then arrival).
    scheduling_policy: str = "fcfs"
    #: LoRA adapters (``_lora.py``): on/off, resident at once per rank, the largest rank, the
    #: adapters loaded at start (name, path), and the simulated load of a non-resident one.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    lora_modules: tuple[tuple[str, str], ...] = ()
    lora_load_delay: float = 0.0
    #: Images (``Capability.VISION``): > 0, the placeholder tokens one image takes; its token
    #: id (None: the vocabulary's last, ``image_token``).
    tokens_per_image: int = 0
    image_token_id: int | None = None

    def __post_init__(self) -> None:
        positive = ("vocab_size", "context_length", "block_size", "num_gpu_blocks", "max_num_seqs",
                    "max_num_batched_tokens", "data_parallel_size", "replay_buffer_size",
                    "max_loras", "max_lora_rank")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.speedup_ratio > 0:
            raise ValueError(f"speedup_ratio must be > 0, got {self.speedup_ratio}")
        if not 0 <= self.prefill_ms_per_token < float("inf"):
            raise ValueError(
                f"prefill_ms_per_token must be >= 0, got {self.prefill_ms_per_token}"
            )
        for name in ("kv_events_port", "kv_replay_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} out of range: {getattr(self, name)}")
        if self.kv_bytes_per_token < 0:
            raise ValueError(f"kv_bytes_per_token must be >= 0, got {self.kv_bytes_per_token}")
        if not self.kv_transfer_bandwidth > 0:
            raise ValueError(
                f"kv_transfer_bandwidth must be > 0, got {self.kv_transfer_bandwidth}"
            )
        if not 0 <= self.lora_load_delay < float("inf"):
            raise ValueError(f"lora_load_delay must be >= 0, got {self.lora_load_delay}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if self.tokens_per_image < 0:
            raise ValueError(f"tokens_per_image must be >= 0, got {self.tokens_per_image}")
        if not 0 <= self.image_token < self.vocab_size:
            raise ValueError(f"image_token_id must be in [0, {self.vocab_size}), "
                             f"got {self.image_token_id}")
        if self.embedding_dim < 0:
            raise ValueError(f"embedding_dim must be >= 0, got {self.embedding_dim}")
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        if self.kv_event_form not in KV_EVENT_FORMS:
            raise ValueError(f"kv_event_form must be one of {KV_EVENT_FORMS}, "
                             f"got {self.kv_event_form!r}")

    @property
    def image_token(self) -> int:
        """The token id of an image's placeholder positions (``--image-token-id``, else the
        vocabulary's last id)."""
        return self.vocab_size - 1 if self.image_token_id is None else self.image_token_id

    @property
    def bind_host(self) -> str:
        """The ZMQ bind address of the KV-event sockets (``*`` for every interface)."""
        return "*" if self.host is None or self.host in _WILDCARDS else self.host

    def advertised_host(self) -> str:
        """The address routers should connect to: ``advertise`` if set, else the bind host,
        loopback when none was given, or this machine's address for a wildcard bind."""
        if self.advertise:
            return self.advertise
        if self.host is None:
            return "127.0.0.1"
        if self.host not in _WILDCARDS:
            return self.host
        from dynamo_zmq.runtime import RuntimeConfig

        return RuntimeConfig(host="0.0.0.0").advertised_hosts()[0]


def add_mocker_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add the mocker's flags (names as in Dynamo's mocker), each defaulting to its ``DYN_*``
    variable (``--block-size`` -> ``DYN_BLOCK_SIZE``; ``--no-kv-events``: ``DYN_KV_EVENTS=0``)."""
    env = os.environ.get
    add = parser.add_argument
    add("--block-size", type=int, default=env("DYN_BLOCK_SIZE", 64),
        help="tokens per KV block [DYN_BLOCK_SIZE]")
    add("--num-gpu-blocks-override", type=int, default=env("DYN_NUM_GPU_BLOCKS_OVERRIDE", 16384),
        help="KV blocks per data-parallel rank [DYN_NUM_GPU_BLOCKS_OVERRIDE]")
    add("--max-num-seqs", type=int, default=env("DYN_MAX_NUM_SEQS", 256),
        help="running sequences per rank [DYN_MAX_NUM_SEQS]")
    add("--max-num-batched-tokens", type=int, default=env("DYN_MAX_NUM_BATCHED_TOKENS", 8192),
        help="token budget of one step [DYN_MAX_NUM_BATCHED_TOKENS]")
    add("--speedup-ratio", type=float, default=env("DYN_SPEEDUP_RATIO", 1.0),
        help="divide every simulated step time by this [DYN_SPEEDUP_RATIO]")
    add("--prefill-ms-per-token", type=float, default=env("DYN_PREFILL_MS_PER_TOKEN", 0.0),
        help="> 0: prefill costs this many ms per uncached token (no fixed part) instead of "
        "Dynamo's fit [DYN_PREFILL_MS_PER_TOKEN]")
    add("--data-parallel-size", type=int, default=env("DYN_DATA_PARALLEL_SIZE", 1),
        help="data-parallel ranks in this engine [DYN_DATA_PARALLEL_SIZE]")
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
        default=env("DYN_ENABLE_PREFIX_CACHING", "1") != "0",
        help="reuse cached KV blocks of shared prefixes [DYN_ENABLE_PREFIX_CACHING=0: off]")
    add("--mocker-seed", type=int, default=env("DYN_MOCKER_SEED", 0),
        help="base seed of the generated tokens [DYN_MOCKER_SEED]")
    add("--kv-events-port", type=int, default=env("DYN_KV_EVENTS_PORT", 0),
        help="KV-event PUB port (0 = any) [DYN_KV_EVENTS_PORT]")
    add("--kv-replay-port", type=int, default=env("DYN_KV_REPLAY_PORT", 0),
        help="KV-event replay ROUTER port (0 = any) [DYN_KV_REPLAY_PORT]")
    add("--no-kv-events", action="store_true", default=env("DYN_KV_EVENTS", "1") == "0",
        help="do not publish KV events [DYN_KV_EVENTS=0]")
    add("--kv-replay-buffer-size", type=int, default=env("DYN_KV_REPLAY_BUFFER_SIZE", 10_000),
        help="KV-event batches kept for replay (a late router gets a full dump regardless) "
             "[DYN_KV_REPLAY_BUFFER_SIZE]")
    add("--mock-embedding-dim", type=int, default=env("DYN_MOCK_EMBEDDING_DIM", 0),
        help="serve deterministic embeddings of this many dimensions (0 = no embeddings) "
             "[DYN_MOCK_EMBEDDING_DIM]")
    add("--kv-bytes-per-token", type=int, default=env("DYN_KV_BYTES_PER_TOKEN", 131072),
        help="KV bytes per token a disaggregated transfer models (default: Llama-3-8B bf16) "
             "[DYN_KV_BYTES_PER_TOKEN]")
    add("--kv-transfer-bandwidth", type=float, default=env("DYN_KV_TRANSFER_BANDWIDTH", 25.0),
        help="modeled KV transfer bandwidth from a prefill worker, GB/s "
             "[DYN_KV_TRANSFER_BANDWIDTH]")
    add("--kv-hash-seed", type=int, default=env("DYN_KV_HASH_SEED"),
        help="root seed of the block hashes published with KV events (default: the router's; "
             "another one shows the router's hash-scheme mismatch diagnosis) [DYN_KV_HASH_SEED]")
    add("--kv-event-form", choices=KV_EVENT_FORMS, default=env("DYN_KV_EVENT_FORM", FORM_DELTAS),
        help="KV-event payloads: 'stores' (vLLM's events with the router's own block hashes) or "
             "'deltas', the default (only the own hashes that enter or leave each rank; smaller "
             "and cheaper for routers that read them; Dynamo's router cannot read them) "
             "[DYN_KV_EVENT_FORM]")
    add("--enable-lora", action=argparse.BooleanOptionalAction,
        default=env("DYN_ENABLE_LORA", "0") not in ("0", ""),
        help="serve LoRA adapters (simulated: see --lora-load-delay) [DYN_ENABLE_LORA=1]")
    add("--max-loras", type=int, default=env("DYN_MAX_LORAS", 1),
        help="LoRA adapters resident at once per rank; a request for another one evicts the "
             "least recently used idle one [DYN_MAX_LORAS]")
    add("--max-lora-rank", type=int, default=env("DYN_MAX_LORA_RANK", 16),
        help="largest LoRA rank (r) an adapter may have [DYN_MAX_LORA_RANK]")
    add("--lora-modules", nargs="+", metavar="NAME=PATH",
        default=env("DYN_LORA_MODULES", "").split(),
        help="LoRA adapters to load at start (peft directories) [DYN_LORA_MODULES, "
             "space-separated]")
    add("--lora-load-delay", type=float, default=env("DYN_LORA_LOAD_DELAY", 0.0),
        metavar="SECONDS",
        help="simulated load of a non-resident adapter before its request's prefill (divided "
             "by --speedup-ratio) [DYN_LORA_LOAD_DELAY]")
    add("--tokens-per-image", type=int, default=env("DYN_TOKENS_PER_IMAGE", 0), metavar="N",
        help="take images (the vision capability), each N placeholder tokens long; 0 = no "
             "images [DYN_TOKENS_PER_IMAGE]")
    add("--image-token-id", type=int, default=env("DYN_IMAGE_TOKEN_ID"), metavar="ID",
        help="with --tokens-per-image: the image placeholder token id (default: the "
             "vocabulary's last id) [DYN_IMAGE_TOKEN_ID]")
    add("--scheduling-policy", choices=POLICIES, default=env("DYN_SCHEDULING_POLICY", "fcfs"),
        help="order of the waiting queue: 'fcfs' (arrival) or 'priority' (the request's "
             "priority, lower first, then arrival; vLLM's flag) [DYN_SCHEDULING_POLICY]")


def read_model_dir(path: str | Path) -> dict[str, Any]:
    """``vocab_size``, ``context_length`` and ``eos_token_ids`` found in a model directory."""
    root = Path(path)
    cfg = _read_json(root / "config.json")
    if cfg is None:
        raise FileNotFoundError(f"{root / 'config.json'} not found")
    found: dict[str, Any] = {}
    if isinstance(cfg.get("vocab_size"), int):
        found["vocab_size"] = cfg["vocab_size"]
    if isinstance(cfg.get("max_position_embeddings"), int):
        found["context_length"] = cfg["max_position_embeddings"]
    eos = _eos_ids(cfg.get("eos_token_id"))
    gen = _read_json(root / "generation_config.json") or {}
    eos += [t for t in _eos_ids(gen.get("eos_token_id")) if t not in eos]
    found["eos_token_ids"] = tuple(eos)
    return found


def config_from_args(args: argparse.Namespace) -> MockerConfig:
    """Build a ``MockerConfig`` from the worker's parsed flags (missing flags take defaults).

    Raises:
        InvalidArgument: a flag out of range, or a model directory without a readable
            config.json.
    """
    try:
        return _config_from_args(args)
    except (OSError, ValueError) as exc:  # MockerConfig's checks, a missing or bad config.json
        raise InvalidArgument(str(exc)) from exc


def _config_from_args(args: argparse.Namespace) -> MockerConfig:
    def get(name: str, default: Any) -> Any:
        value = getattr(args, name, None)
        return default if value is None else value

    host, advertise = _hosts(args)
    model_path = getattr(args, "model_path", None)
    from_dir = read_model_dir(model_path) if model_path else {}
    name = getattr(args, "model_name", None) or (
        Path(model_path).resolve().name if model_path else "mocker"
    )
    return MockerConfig(
        model_name=name,
        model_path=str(model_path) if model_path else None,
        block_size=get("block_size", 64),
        num_gpu_blocks=get("num_gpu_blocks_override", 16384),
        max_num_seqs=get("max_num_seqs", 256),
        max_num_batched_tokens=get("max_num_batched_tokens", 8192),
        speedup_ratio=get("speedup_ratio", 1.0),
        prefill_ms_per_token=get("prefill_ms_per_token", 0.0),
        data_parallel_size=get("data_parallel_size", 1),
        enable_prefix_caching=get("enable_prefix_caching", True),
        seed=get("mocker_seed", 0),
        enable_kv_events=not get("no_kv_events", False),
        kv_events_port=get("kv_events_port", 0),
        kv_replay_port=get("kv_replay_port", 0),
        replay_buffer_size=get("kv_replay_buffer_size", 10_000),
        host=host,
        advertise=advertise,
        embedding_dim=get("mock_embedding_dim", 0),
        kv_bytes_per_token=get("kv_bytes_per_token", 131072),
        kv_transfer_bandwidth=get("kv_transfer_bandwidth", 25.0),
        kv_hash_seed=get("kv_hash_seed", None),
        kv_event_form=get("kv_event_form", FORM_DELTAS),
        scheduling_policy=get("scheduling_policy", "fcfs"),
        enable_lora=get("enable_lora", False),
        max_loras=get("max_loras", 1),
        max_lora_rank=get("max_lora_rank", 16),
        lora_modules=parse_lora_modules(get("lora_modules", ())),
        lora_load_delay=get("lora_load_delay", 0.0),
        tokens_per_image=get("tokens_per_image", 0),
        image_token_id=get("image_token_id", None),
        **from_dir,
    )


def _hosts(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """Bind and advertised host of the KV sockets. Given the worker's flags (``--discovery``
    and friends), bind and advertise as its request plane does (``--advertise-host`` too)."""
    host = getattr(args, "host", None) or None
    if hasattr(args, "discovery"):
        from dynamo_zmq.runtime import RuntimeConfig

        runtime = RuntimeConfig.from_args(args)
        return runtime.bind_host, runtime.advertised_hosts()[0]
    return host, None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:  # bad JSON or not UTF-8
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else None


def _eos_ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []
