"""The adapter's own settings and flags, and how vLLM's engine flags join the worker's parser.

The worker owns ``--model-path`` (vLLM's ``--model`` defaults to it), ``--model-name`` (vLLM's
``--served-model-name`` defaults to it), ``--host``/``--port``, discovery and
``--native-framework-processing`` (alias ``--vllm-processing``). vLLM's
``AsyncEngineArgs`` flags are added next to them unchanged; a vLLM flag whose name the worker
already uses is left out (with vLLM 0.32: ``-h/--help`` and ``--reasoning-parser``). The
worker's ``--reasoning-parser`` has vLLM's destination, ``reasoning_parser``, so its value
reaches vLLM's engine args too (``engine_args_from_args``); no other destination is shared.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from dynamo_zmq import errors
from dynamo_zmq.llm._block_hashing import FORM_DELTAS
from dynamo_zmq.llm._kv_forms import KV_EVENT_FORMS

from ._lora import parse_modules

__all__ = [
    "INSTALL_HINT",
    "STRUCTURED_OUTPUTS_CONFIG",
    "VllmOptions",
    "add_adapter_args",
    "add_vllm_args",
    "engine_args_from_args",
    "import_vllm",
    "options_from_args",
]

log = logging.getLogger("engines.vllm")

INSTALL_HINT = "install the `vllm` extra: pip install 'dynamo-zmq[vllm]'"
_WILDCARDS = ("0.0.0.0", "*", "")
#: vLLM's ``structured_outputs_config`` when not given: llguidance (JSON schema, regex, choice,
#: and grammars in GBNF or Lark) with compact JSON, so that no model can loop on the whitespace
#: a JSON grammar otherwise allows between tokens until ``max_tokens`` cuts the JSON short.
STRUCTURED_OUTPUTS_CONFIG: dict[str, Any] = {"backend": "guidance", "disable_any_whitespace": True}
#: vLLM flags whose default we replace by None, to tell "unset" from a value (see _engine).
_UNSET_DEFAULTS = ("model", "enforce_eager", "structured_outputs_config")


@dataclass(frozen=True)
class VllmOptions:
    """What the adapter itself decides; vLLM's own settings are ``AsyncEngineArgs``."""

    #: Ask vLLM for text and give it the stop strings (``--native-framework-processing``, alias
    #: ``--vllm-processing``); the worker's post-processing then passes the engine's text
    #: through, and frontends tokenize with the model's own tokenizer.
    native_processing: bool = False
    #: Publish vLLM's KV events on ZMQ (``--no-kv-events`` turns them off).
    kv_events: bool = True
    kv_events_port: int = 0
    kv_replay_port: int = 0
    #: Published batches kept for replay (vLLM's ``buffer_steps``; the relay's in deltas form).
    kv_buffer_steps: int = 10_000
    #: What the relay publishes (``KvHashScheme.form``): "stores" or "deltas".
    kv_event_form: str = FORM_DELTAS
    #: Address advertised for the KV-event sockets; None: see ``advertised_host``.
    advertise: str | None = None
    #: Bind host of the worker (only used to choose the advertised address).
    host: str | None = None
    #: Seconds vLLM's engine-core process gets to exit on cleanup before it is killed.
    shutdown_timeout: float = 2.0
    #: The worker's ``--disaggregation-mode``: prefill and decode turn our KV connector on.
    disaggregation_mode: str = "agg"
    #: Port of the KV connector's block server (0 = a free one; prefill and decode roles).
    kv_transfer_port: int = 0
    #: Seconds a finished prefill's blocks wait for their pull before they are freed.
    kv_transfer_ttl: float = 60.0
    #: LoRA adapters loaded at start, (name, path) in order (``--lora-modules``).
    lora_modules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.kv_transfer_ttl <= 0:
            raise errors.InvalidArgument(f"kv_transfer_ttl must be > 0: {self.kv_transfer_ttl}")
        for name in ("kv_events_port", "kv_replay_port", "kv_transfer_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise errors.InvalidArgument(f"{name} out of range: {getattr(self, name)}")
        if self.kv_event_form not in KV_EVENT_FORMS:
            raise errors.InvalidArgument(
                f"kv_event_form must be one of {KV_EVENT_FORMS}: {self.kv_event_form!r}")

    def advertised_host(self) -> str:
        """``advertise``, else the concrete bind host, else loopback (no host given) or this
        machine's address (wildcard host), as the mocker advertises its KV sockets."""
        if self.advertise:
            return self.advertise
        if self.host is None:
            return "127.0.0.1"
        if self.host not in _WILDCARDS:
            return self.host
        from dynamo_zmq.runtime import RuntimeConfig

        return RuntimeConfig(host="0.0.0.0").advertised_hosts()[0]


def _log_to_stderr() -> None:
    # A worker's stdout carries its READY line; vLLM logs to stdout unless told otherwise.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


def import_vllm() -> Any:
    """``import vllm``, or ``InvalidArgument`` saying how to install it."""
    _log_to_stderr()
    try:
        import vllm
        from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: F401
    except ImportError as exc:
        raise errors.InvalidArgument(f"the vllm engine needs vLLM ({exc}); {INSTALL_HINT}") from exc
    return vllm


def add_vllm_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add the adapter's flags (``add_adapter_args``), then vLLM's engine flags (when vLLM is
    installed), which are vLLM's own, passed through unchanged, with no ``DYN_*`` variable."""
    add_adapter_args(parser)
    _add_engine_args(parser)


def add_adapter_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add the adapter's own flags, each defaulting to its ``DYN_*`` variable
    (``--kv-events-port`` -> ``DYN_KV_EVENTS_PORT``; ``--no-kv-events``: ``DYN_KV_EVENTS=0``)."""
    env = os.environ.get
    add = parser.add_argument
    # --native-framework-processing (alias --vllm-processing) is a worker flag: see
    # dynamo_zmq.worker; it reaches options_from_args as ``native_processing``.
    add("--kv-events-port", type=int, default=env("DYN_KV_EVENTS_PORT", 0),
        help="KV-event PUB port (0 = a free one) [DYN_KV_EVENTS_PORT]")
    add("--kv-replay-port", type=int, default=env("DYN_KV_REPLAY_PORT", 0),
        help="KV-event replay ROUTER port (0 = a free one) [DYN_KV_REPLAY_PORT]")
    add("--no-kv-events", action="store_true", default=env("DYN_KV_EVENTS", "1") == "0",
        help="do not publish KV events (also keeps vLLM's --kv-events-config if given) "
             "[DYN_KV_EVENTS=0]")
    add("--kv-event-form", choices=KV_EVENT_FORMS, default=env("DYN_KV_EVENT_FORM", FORM_DELTAS),
        help="KV-event payloads of the relay: 'stores' (vLLM's events with the router's own block "
             "hashes) or 'deltas', the default (only the own hashes that enter or leave each "
             "rank) [DYN_KV_EVENT_FORM]")
    add("--kv-advertise-host", default=env("DYN_KV_ADVERTISE_HOST") or None,
        help="address routers use for the KV-event sockets (and decode workers for KV pulls) "
             "[DYN_KV_ADVERTISE_HOST]")
    add("--lora-modules", nargs="+", metavar="NAME=PATH",
        default=_env_lora_modules(env("DYN_LORA_MODULES", "")),
        help="LoRA adapters to load at start, as vLLM's server takes them: NAME=PATH or "
             "vLLM's JSON form '{\"name\": NAME, \"path\": PATH}' (needs --enable-lora) "
             "[DYN_LORA_MODULES: the same, separated by spaces, or a JSON list]")
    # --kv-transfer-port and --kv-transfer-ttl are worker flags (dynamo_zmq.kv_transfer); the
    # KV connector of a prefill worker binds that port and frees unpulled blocks after the TTL.


def _env_lora_modules(value: str) -> list[str] | None:
    """``DYN_LORA_MODULES`` as ``--lora-modules`` items: a JSON list (of ``NAME=PATH`` strings
    or JSON-form objects) or items separated by whitespace; None when unset or empty. What is
    not well-formed is passed on as one item, for ``parse_modules`` to refuse."""
    value = value.strip()
    if not value:
        return None
    if value.startswith("["):
        try:
            items = json.loads(value)
        except ValueError:
            return [value]
        if not isinstance(items, list):
            return [value]
        return [item if isinstance(item, str) else json.dumps(item) for item in items]
    return value.split()


def _add_engine_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """vLLM's ``AsyncEngineArgs`` flags, but those whose names the parser already has."""
    _log_to_stderr()
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as exc:
        log.debug("vLLM not importable (%s): its engine flags are not offered", exc)
        return
    source = FlexibleArgumentParser(add_help=False)
    AsyncEngineArgs.add_cli_args(source)
    taken = parser._option_string_actions  # shared with the parser when this is a group
    for action in source._actions:
        clash = [s for s in action.option_strings if s in taken]
        if clash or not action.option_strings:
            if clash:
                log.debug("vLLM flag %s clashes with the worker's: left out", "/".join(clash))
            continue
        if action.dest in _UNSET_DEFAULTS:
            action.default = None
        parser._add_action(action)


def engine_args_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's ``AsyncEngineArgs`` fields from parsed flags (the worker's model flags mapped in)."""
    import_vllm()
    from vllm.engine.arg_utils import AsyncEngineArgs

    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    kwargs = {name: getattr(args, name) for name in fields if hasattr(args, name)}
    model_path = getattr(args, "model_path", None)
    if kwargs.get("model") is None:
        if model_path is None:
            raise errors.InvalidArgument("the vllm engine needs --model-path (or --model)")
        kwargs["model"] = str(model_path)
    model_name = getattr(args, "model_name", None)
    if model_name and not kwargs.get("served_model_name"):
        kwargs["served_model_name"] = [model_name]
    return kwargs


def options_from_args(args: argparse.Namespace) -> VllmOptions:
    host = getattr(args, "host", None) or None
    advertise = getattr(args, "kv_advertise_host", None)
    if advertise is None and hasattr(args, "discovery"):  # as the request plane (and its pin)
        from dynamo_zmq.runtime import RuntimeConfig

        runtime = RuntimeConfig.from_args(args)
        host, advertise = runtime.bind_host, runtime.advertised_hosts()[0]
    return VllmOptions(
        native_processing=bool(getattr(args, "native_processing", False)),
        kv_events=not getattr(args, "no_kv_events", False),
        kv_events_port=int(getattr(args, "kv_events_port", 0) or 0),
        kv_replay_port=int(getattr(args, "kv_replay_port", 0) or 0),
        kv_event_form=str(getattr(args, "kv_event_form", None) or FORM_DELTAS),
        advertise=advertise,
        host=host,
        disaggregation_mode=str(getattr(args, "disaggregation_mode", None) or "agg"),
        kv_transfer_port=int(getattr(args, "kv_transfer_port", 0) or 0),
        kv_transfer_ttl=float(getattr(args, "kv_transfer_ttl", 60.0) or 60.0),
        lora_modules=parse_modules(getattr(args, "lora_modules", None) or ()),
    )
