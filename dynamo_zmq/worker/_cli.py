"""``python -m dynamo_zmq.worker``: serve one engine on the request plane.

    python -m dynamo_zmq.worker --engine mocker --model-path DIR [--model-name NAME]
        [--namespace dynamo] [--component backend] [--endpoint generate]
        [--host H] [--port P] [--discovery mdns|static] [--disaggregation-mode agg|prefill|decode]
        [--system-port P] [--health-check-payload JSON] [--load-interval 0.1] [--load-port P]
        [engine flags...]

Every flag has a ``DYN_*`` environment variable (``--model-path`` -> ``DYN_MODEL_PATH``).
Engines are found by name in the ``dynamo_zmq.engines`` entry-point group, or as
``MODULE:CLASS``. Once serving, the worker prints ``READY <address> <instance id hex>``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from .. import errors
from ..llm import (
    ENGINES,
    MAX_LOAD_INTERVAL,
    LLMEngine,
    PreprocessedRequest,
    load_plugin,
    plugin_names,
)
from ..runtime import add_runtime_args, check_name, run_main, setup_logging, system_port_from_env
from ._worker import Worker

__all__ = ["build_parser", "load_engine_class", "main", "parse_args"]


def _env(name: str, default: Any = None) -> Any:
    return os.environ.get(f"DYN_{name}", default)


def load_engine_class(spec: str) -> type[LLMEngine]:
    """``NAME`` from the entry-point group, or ``package.module:Class``."""
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise errors.InvalidArgument(f"cannot load engine {spec!r}: {exc}") from exc
    else:
        if spec not in (names := plugin_names(ENGINES)):
            known = ", ".join(names) or "none installed"
            raise errors.InvalidArgument(
                f"unknown engine {spec!r} (known: {known}; or use MODULE:CLASS)"
            )
        cls = load_plugin(ENGINES, spec)
    if not (isinstance(cls, type) and issubclass(cls, LLMEngine)):
        raise errors.InvalidArgument(f"engine {spec!r} is not an LLMEngine subclass")
    return cls


def build_parser(
    engine_cls: type[LLMEngine] | None = None, add_help: bool = True
) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dynamo_zmq.worker",
        description="Serve an LLM engine on the dynamo-zmq request plane.",
        add_help=add_help,
    )
    parser.add_argument(
        "--engine", default=_env("ENGINE", "mocker"),
        help="engine name or MODULE:CLASS [DYN_ENGINE]",
    )
    parser.add_argument(
        "--model-path", default=_env("MODEL_PATH"), help="model directory [DYN_MODEL_PATH]"
    )
    parser.add_argument(
        "--model-name", default=_env("MODEL_NAME"), help="served model name [DYN_MODEL_NAME]"
    )
    parser.add_argument("--namespace", default=_env("NAMESPACE", "dynamo"), help="[DYN_NAMESPACE]")
    parser.add_argument("--component", default=_env("COMPONENT", "backend"), help="[DYN_COMPONENT]")
    parser.add_argument("--endpoint", default=_env("ENDPOINT", "generate"), help="[DYN_ENDPOINT]")
    parser.add_argument(
        "--disaggregation-mode", choices=["agg", "prefill", "decode"],
        default=_env("DISAGGREGATION_MODE", "agg"), help="[DYN_DISAGGREGATION_MODE]",
    )
    parser.add_argument(
        "--system-port", "--metrics-port", dest="system_port", type=int,
        default=system_port_from_env(),
        help="serve /metrics, /health, /live on this port (0 = any, negative = off) "
             "[DYN_SYSTEM_PORT; DYN_SYSTEM_ENABLED=true alone: 8081, =false: off]",
    )
    parser.add_argument(
        "--health-check-interval", type=float, default=_env("HEALTH_CHECK_INTERVAL", "10.0"),
        help="run the health canary after this many idle seconds [DYN_HEALTH_CHECK_INTERVAL]",
    )
    parser.add_argument(
        "--health-check-payload", default=_env("HEALTH_CHECK_PAYLOAD"),
        help="the canary request, a PreprocessedRequest as JSON (default: one token) "
             "[DYN_HEALTH_CHECK_PAYLOAD]",
    )
    parser.add_argument(
        "--grace-period", type=float, default=_env("GRACE_PERIOD", "0.5"),
        help="seconds between unregistering and refusing new requests [DYN_GRACE_PERIOD]",
    )
    parser.add_argument(
        "--graceful-timeout", type=float, default=_env("GRACEFUL_TIMEOUT", "30.0"),
        help="seconds to wait for in-flight requests on shutdown [DYN_GRACEFUL_TIMEOUT]",
    )
    parser.add_argument(
        "--load-interval", type=float, default=_env("LOAD_INTERVAL", "0.1"),
        help="publish the engine's load for KV routers every this many seconds, 0 = never, "
             f"at most {MAX_LOAD_INTERVAL:g} (engines without load() publish nothing) "
             "[DYN_LOAD_INTERVAL]",
    )
    parser.add_argument(
        "--load-port", type=int, default=_env("LOAD_PORT", "0"),
        help="port of the load PUB socket, 0 = any [DYN_LOAD_PORT]",
    )
    parser.add_argument(
        "--debug-streams", action="store_true", default=_env("DEBUG_STREAMS", "") == "1",
        help="validate every engine stream (one terminal, last) [DYN_DEBUG_STREAMS=1]",
    )
    add_runtime_args(parser)
    if engine_cls is not None:
        group = parser.add_argument_group(f"{engine_cls.name or engine_cls.__name__} engine")
        engine_cls.add_args(group)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> tuple[type[LLMEngine], argparse.Namespace]:
    """Two passes: find ``--engine``, then parse with that engine's own flags added."""
    # --help waits for the engine's flags
    pre, _ = build_parser(add_help=False).parse_known_args(argv)
    engine_cls = load_engine_class(pre.engine)
    args = build_parser(engine_cls).parse_args(argv)
    for what in ("namespace", "component", "endpoint"):
        check_name(getattr(args, what), what)
    if args.model_path is not None and not Path(args.model_path).is_dir():
        raise errors.InvalidArgument(f"--model-path {args.model_path!r} is not a directory")
    if args.system_port is not None and args.system_port < 0:
        args.system_port = None  # Dynamo's -1: no system server
    args.health_check_payload = parse_health_check_payload(args.health_check_payload)
    if not 0 <= args.load_interval <= MAX_LOAD_INTERVAL:
        raise errors.InvalidArgument(
            f"--load-interval must be 0 (never) or up to {MAX_LOAD_INTERVAL:g} s, "
            f"got {args.load_interval:g}"
        )
    return engine_cls, args


def parse_health_check_payload(text: str | None) -> PreprocessedRequest | None:
    """The canary request from its JSON (``--health-check-payload``); None: the default.

    Raises:
        InvalidArgument: not JSON, or not a ``PreprocessedRequest``.
    """
    if text is None or isinstance(text, PreprocessedRequest):
        return text
    try:
        return msgspec.json.decode(text, type=PreprocessedRequest)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise errors.InvalidArgument(
            f"--health-check-payload is not a PreprocessedRequest as JSON: {exc}"
        ) from exc


def main(argv: Sequence[str] | None = None) -> int:
    setup_logging()
    try:
        engine_cls, args = parse_args(argv)
        engine = engine_cls.from_args(args)
    except errors.DynamoError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    return run_main(Worker(engine, args).run())

