"""``WorkerConfig``: the worker's settings as one typed object (Dynamo's ``WorkerConfig``), so a
worker can be configured from code as well as from flags (``from_namespace``)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from ..errors import InvalidArgument
from ..kv_transfer import KvTransferConfig
from ..llm import MAX_LOAD_INTERVAL, PreprocessedRequest
from ..llm.parsers import REASONING_PARSERS, TOOL_PARSERS
from ..runtime import RuntimeConfig, check_name

__all__ = ["DISAGGREGATION_MODES", "WorkerConfig"]

DISAGGREGATION_MODES = ("agg", "prefill", "decode")


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a ``Worker`` needs besides its engine. Each field is a flag of
    ``python -m dynamo_zmq.worker`` (``--model-path`` -> ``model_path``); the request plane's
    (``--host``, ``--port``, discovery, ``--grace-period``, ``--graceful-timeout``) are in
    ``runtime``.

    Raises:
        InvalidArgument: a bad name, mode or number.
    """

    #: The model directory (tokenizer files for the model card); required to serve.
    model_path: str | None = None
    #: Served model name (default: what the engine reports).
    model_name: str | None = None
    namespace: str = "dynamo"
    component: str = "backend"
    endpoint: str = "generate"
    disaggregation_mode: str = "agg"
    #: Dynamo's system port: ``/metrics``, ``/health`` and ``/live`` (0 = any; None = not
    #: served).
    system_port: int | None = None
    #: The address the system port binds: loopback unless told (it has no authentication).
    system_host: str = "127.0.0.1"
    #: Idle seconds before the health canary runs again.
    health_check_interval: float = 10.0
    #: The canary request (None: one token); while it fails the worker leaves routing.
    health_check_payload: PreprocessedRequest | None = None
    #: Seconds between load reports for KV routers (0 = never).
    load_interval: float = 0.1
    load_port: int = 0
    #: Validate every engine stream (one terminal, last).
    debug_streams: bool = False
    #: Migrations a request of this model may make, advertised to frontends, whose own
    #: ``--migration-limit`` it overrides (None: the frontend's; 0: never).
    migration_limit: int | None = None
    #: Tool-call parser (``llm.parsers.TOOL_PARSERS``; None: from the model's chat template).
    tool_call_parser: str | None = None
    #: Reasoning parser (``llm.parsers.REASONING_PARSERS``; None: from the chat template).
    reasoning_parser: str | None = None
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    #: KV transfer of a ``prefill`` or ``decode`` worker (``--kv-transfer-*``).
    kv_transfer: KvTransferConfig = field(default_factory=KvTransferConfig)
    #: Workers ``python -m dynamo_zmq.worker`` serves from one process, each built from the
    #: same flags (``--workers-per-process``; test fleets). ``run`` serves one regardless.
    workers_per_process: int = 1

    def __post_init__(self) -> None:
        for what in ("namespace", "component", "endpoint"):
            check_name(getattr(self, what), what)
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise InvalidArgument(
                f"disaggregation mode must be one of {', '.join(DISAGGREGATION_MODES)}, "
                f"got {self.disaggregation_mode!r}"
            )
        if not 0 <= self.load_interval <= MAX_LOAD_INTERVAL:
            raise InvalidArgument(
                f"--load-interval must be 0 (never) or up to {MAX_LOAD_INTERVAL:g} s, "
                f"got {self.load_interval:g}"
            )
        if self.migration_limit is not None and self.migration_limit < 0:
            raise InvalidArgument(f"--migration-limit must be >= 0, got {self.migration_limit}")
        for what, value, known in (("--tool-call-parser", self.tool_call_parser, TOOL_PARSERS),
                                   ("--reasoning-parser", self.reasoning_parser,
                                    REASONING_PARSERS)):
            if value is not None and value not in known:
                raise InvalidArgument(f"{what}: unknown parser {value!r} "
                                      f"(known: {', '.join(sorted(known))})")
        if self.workers_per_process < 1:
            raise InvalidArgument(
                f"--workers-per-process must be >= 1, got {self.workers_per_process}"
            )
        for name in ("system_port", "load_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                raise InvalidArgument(f"{name} {port} out of range")

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> WorkerConfig:
        """The settings in the worker's parsed flags (``dynamo_zmq.worker.build_parser``)."""
        runtime = dataclasses.replace(
            RuntimeConfig.from_args(args),
            grace_period=float(args.grace_period),
            graceful_timeout=float(args.graceful_timeout),
        )
        return cls(
            model_path=None if args.model_path is None else str(args.model_path),
            model_name=args.model_name or None,
            namespace=args.namespace,
            component=args.component,
            endpoint=args.endpoint,
            disaggregation_mode=args.disaggregation_mode,
            system_port=None if args.system_port is None else int(args.system_port),
            system_host=str(getattr(args, "system_host", None) or "127.0.0.1"),
            health_check_interval=float(args.health_check_interval),
            health_check_payload=args.health_check_payload,
            load_interval=float(args.load_interval),
            load_port=int(args.load_port),
            debug_streams=bool(args.debug_streams),
            migration_limit=(
                None if getattr(args, "migration_limit", None) is None
                else int(args.migration_limit)
            ),
            tool_call_parser=getattr(args, "tool_call_parser", None) or None,
            reasoning_parser=getattr(args, "reasoning_parser", None) or None,
            runtime=runtime,
            kv_transfer=KvTransferConfig.from_namespace(args),
            workers_per_process=int(getattr(args, "workers_per_process", 1) or 1),
        )
