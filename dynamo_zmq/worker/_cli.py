"""``python -m dynamo_zmq.worker``: serve one engine on the request plane.

    python -m dynamo_zmq.worker --engine mocker --model-path DIR|ORG/NAME [--model-name NAME]
        [--namespace dynamo] [--component backend] [--endpoint generate]
        [--host H] [--port P] [--discovery mdns|static] [--disaggregation-mode agg|prefill|decode]
        [--system-port P] [--health-check-payload JSON] [--load-interval 0.1] [--load-port P]
        [--native-framework-processing] [--tool-call-parser NAME] [--reasoning-parser NAME]
        [--workers-per-process N] [engine flags...]

Every flag but ``--help`` has a ``DYN_*`` environment variable (``--model-path`` ->
``DYN_MODEL_PATH``), the engine's own included, except vLLM's engine flags, which the vllm
engine passes through unchanged. Engines are found by name in the ``dynamo_zmq.engines``
entry-point group (``--help`` lists those installed), or as ``MODULE:CLASS``. Once serving,
the worker prints ``READY <address> <instance id hex>``.

The same from code: ``engine, config = from_args(argv)`` (or ``MockerEngine.from_args(argv)``),
then ``run(engine, config)``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any, TypeVar, overload

import msgspec

from .. import errors
from ..kv_transfer import add_kv_transfer_args
from ..llm import (
    ENGINES,
    MAX_LOAD_INTERVAL,
    LLMEngine,
    PreprocessedRequest,
    load_plugin,
    plugin_names,
)
from ..llm.parsers import REASONING_PARSERS, TOOL_PARSERS
from ..runtime import add_runtime_args, setup_logging, system_port_from_env
from ._config import DISAGGREGATION_MODES, WorkerConfig
from ._model_path import resolve_model_path
from ._run import run, run_many

__all__ = [
    "NATIVE_PROCESSING_FLAGS",
    "build_parser",
    "from_args",
    "load_engine_class",
    "main",
    "parse_args",
]

E = TypeVar("E", bound=LLMEngine)

#: The native-processing document's flag and its engine-named aliases (plus our older
#: ``--native-processing``): the engine does its own pre- and post-processing.
NATIVE_PROCESSING_FLAGS = (
    "--native-framework-processing",
    "--vllm-processing",
    "--sglang-processing",
    "--trtllm-processing",
    "--native-processing",
)
#: Engines a ``--NAME-processing`` alias names.
_NAMED_ENGINES = ("vllm", "sglang", "trtllm")


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


class _NativeProcessing(argparse.Action):
    """Sets ``native_processing`` and remembers which spelling was given, since an
    engine-named alias must name the engine that runs."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
        values: Any, option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, True)
        namespace.native_processing_flag = option_string


def build_parser(
    engine_cls: type[LLMEngine] | None = None, add_help: bool = True
) -> argparse.ArgumentParser:
    """The worker's flags, and ``engine_cls``'s own when given."""
    parser = argparse.ArgumentParser(
        prog="python -m dynamo_zmq.worker",
        description="Serve an LLM engine on the dynamo-zmq request plane.",
        add_help=add_help,
    )
    installed = ", ".join(plugin_names(ENGINES)) or "none"
    parser.add_argument(
        "--engine", default=_env("ENGINE", "mocker"),
        help=f"engine name (installed: {installed}) or MODULE:CLASS [DYN_ENGINE]",
    )
    parser.add_argument(
        "--model-path", default=_env("MODEL_PATH"),
        help="model directory, or a Hugging Face model id (ORG/NAME) already in the local "
             "Hugging Face cache (HF_HUB_CACHE; nothing is downloaded) [DYN_MODEL_PATH]",
    )
    parser.add_argument(
        "--model-name", default=_env("MODEL_NAME"), help="served model name [DYN_MODEL_NAME]"
    )
    parser.add_argument("--namespace", default=_env("NAMESPACE", "dynamo"), help="[DYN_NAMESPACE]")
    parser.add_argument("--component", default=_env("COMPONENT", "backend"), help="[DYN_COMPONENT]")
    parser.add_argument("--endpoint", default=_env("ENDPOINT", "generate"), help="[DYN_ENDPOINT]")
    parser.add_argument(
        "--disaggregation-mode", choices=DISAGGREGATION_MODES,
        default=_env("DISAGGREGATION_MODE", "agg"), help="[DYN_DISAGGREGATION_MODE]",
    )
    parser.add_argument(
        "--system-port", "--metrics-port", dest="system_port", type=int,
        default=system_port_from_env(),
        help="serve /metrics, /health, /live on this port (0 = any, negative = off) "
             "[DYN_SYSTEM_PORT; DYN_SYSTEM_ENABLED=true alone: 8081, =false: off]",
    )
    parser.add_argument(
        "--system-host", default=_env("SYSTEM_HOST", "127.0.0.1"),
        help="address the system port binds (default loopback: no other host reaches its "
             "/metrics and /health; 0.0.0.0 or a management address to scrape it from "
             "another host) [DYN_SYSTEM_HOST]",
    )
    parser.add_argument(
        "--health-check-interval", type=float, default=_env("HEALTH_CHECK_INTERVAL", "10.0"),
        help="run the health canary after this many idle seconds, and this often while busy "
             "(also at once when the engine stalls) [DYN_HEALTH_CHECK_INTERVAL]",
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
        "--migration-limit", type=int, default=_env("MIGRATION_LIMIT"),
        help="how many times a request of this model may move to another worker when the one "
             "serving it is lost mid-stream; frontends use it instead of their own "
             "--migration-limit (default: the frontend's; 0 = never) [DYN_MIGRATION_LIMIT]",
    )
    parser.add_argument(
        "--workers-per-process", type=int, default=_env("WORKERS_PER_PROCESS", "1"),
        metavar="N",
        help="serve N workers from this process, each with its own engine, runtime, sockets, "
             "instance id and advert (test fleets; every port flag must then be 0) "
             "[DYN_WORKERS_PER_PROCESS]",
    )
    parser.add_argument(
        "--debug-streams", action="store_true", default=_env("DEBUG_STREAMS", "") == "1",
        help="validate every engine stream (one terminal, last) [DYN_DEBUG_STREAMS=1]",
    )
    parser.add_argument(
        *NATIVE_PROCESSING_FLAGS, dest="native_processing", action=_NativeProcessing,
        default=_env("NATIVE_FRAMEWORK_PROCESSING", "") == "1",
        help="the engine's own processing: the frontend tokenizes with the model's own "
             "tokenizer and chat template, the engine detokenizes and applies stop strings "
             "(engines that support it: vllm; an engine-named alias must name the engine) "
             "[DYN_NATIVE_FRAMEWORK_PROCESSING=1]",
    )
    parser.add_argument(
        "--tool-call-parser", default=_env("TOOL_CALL_PARSER"),
        choices=sorted(TOOL_PARSERS),
        help="parse the model's tool calls out of its text with this family's parser "
             "(default: from the model's chat template, else none) [DYN_TOOL_CALL_PARSER]",
    )
    parser.add_argument(
        "--reasoning-parser", default=_env("REASONING_PARSER"),
        choices=sorted(REASONING_PARSERS),
        help="move the model's reasoning text to reasoning_content with this parser "
             "(default: from the model's chat template, else none) [DYN_REASONING_PARSER]",
    )
    add_runtime_args(parser)
    add_kv_transfer_args(
        parser.add_argument_group("KV transfer (--disaggregation-mode prefill|decode)")
    )
    if engine_cls is not None:
        group = parser.add_argument_group(f"{engine_cls.name or engine_cls.__name__} engine")
        engine_cls.add_args(group)
    return parser


def parse_args(
    argv: Sequence[str] | None = None, engine: type[LLMEngine] | None = None
) -> tuple[type[LLMEngine], argparse.Namespace]:
    """The engine class and the parsed flags: the engine from ``--engine`` (or ``engine``),
    then its own flags added. ``--model-path`` is resolved to a directory (a hub id: its cached
    snapshot, the id becoming the default ``--model-name``).

    Raises:
        InvalidArgument: an unknown engine, a missing model, or a flag the engine refuses.
    """
    if engine is None:  # --help waits for the engine's flags
        pre, _ = build_parser(add_help=False).parse_known_args(argv)
        engine_cls = load_engine_class(pre.engine)
    else:
        engine_cls = engine
    parser = build_parser(engine_cls)
    if engine is not None:
        parser.set_defaults(engine=engine.name or f"{engine.__module__}:{engine.__qualname__}")
    args = parser.parse_args(argv)
    if engine is not None and args.engine != parser.get_default("engine"):
        if load_engine_class(args.engine) is not engine:
            raise errors.InvalidArgument(
                f"--engine {args.engine} given to {engine.__name__}.from_args"
            )
    _check_native_processing(engine_cls, args)
    _check_fixed_ports(args)
    if args.system_port is not None and args.system_port < 0:
        args.system_port = None  # Dynamo's -1: no system server
    args.health_check_payload = parse_health_check_payload(args.health_check_payload)
    if args.model_path is not None:
        args.model_path, hub_id = resolve_model_path(args.model_path)
        if hub_id is not None and not args.model_name:
            args.model_name = hub_id
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


def _check_fixed_ports(args: argparse.Namespace) -> None:
    """Several workers in one process cannot share a fixed port: every port flag must be 0."""
    if int(getattr(args, "workers_per_process", 1) or 1) <= 1:
        return
    fixed = sorted(
        f"--{name.replace('_', '-')} {value}" for name, value in vars(args).items()
        if (name == "port" or name.endswith("_port")) and isinstance(value, int) and value > 0
    )
    if fixed:
        raise errors.InvalidArgument(
            f"--workers-per-process {args.workers_per_process} needs every port to be 0 "
            f"(any free one), got {', '.join(fixed)}"
        )


def _check_native_processing(engine_cls: type[LLMEngine], args: argparse.Namespace) -> None:
    if not args.native_processing:
        return
    flag = getattr(args, "native_processing_flag", None) or "DYN_NATIVE_FRAMEWORK_PROCESSING"
    running = engine_cls.name or engine_cls.__name__
    named = flag.removeprefix("--").removesuffix("-processing")
    if named in _NAMED_ENGINES and named != running:
        raise errors.InvalidArgument(
            f"{flag} asks the {named} engine for its native processing, but this worker runs "
            f"{running} (use --native-framework-processing)"
        )
    if not engine_cls.supports_native_processing:
        raise errors.InvalidArgument(f"{flag}: the {running} engine has no native processing")


@overload
def from_args(
    argv: Sequence[str] | None = None, engine: None = None
) -> tuple[LLMEngine, WorkerConfig]: ...


@overload
def from_args(argv: Sequence[str] | None, engine: type[E]) -> tuple[E, WorkerConfig]: ...


def from_args(
    argv: Sequence[str] | None = None, engine: type[LLMEngine] | None = None
) -> tuple[LLMEngine, WorkerConfig]:
    """An engine (not started) and the worker's settings from command-line flags
    (``sys.argv[1:]`` when ``argv`` is None), for ``run(engine, config)``. With ``engine`` the
    class is fixed (``--engine`` may be left out); each engine's own ``from_args`` calls this.

    Raises:
        InvalidArgument: bad settings (``python -m dynamo_zmq.worker`` prints it, exits 2).
        SystemExit: a flag argparse cannot parse (it prints the usage first).
    """
    engine_cls, args = parse_args(argv, engine)
    config = WorkerConfig.from_namespace(args)
    built = engine_cls.from_namespace(args)
    if not isinstance(built, engine_cls):
        raise errors.InvalidArgument(
            f"{engine_cls.__name__}.from_namespace returned a {type(built).__name__}"
        )
    return built, config


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m dynamo_zmq.worker``: ``from_args`` then ``run`` (``run_many`` with
    ``--workers-per-process N``); returns the exit status."""
    setup_logging()
    try:
        engine, config = from_args(argv)
        count = config.workers_per_process
        built = [(engine, config)] + [from_args(argv) for _ in range(count - 1)]
    except errors.DynamoError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    return run(engine, config) if count == 1 else run_many(built)
