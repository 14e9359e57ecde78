"""The engine contract: what a worker needs from an inference engine, and the messages it speaks.

Lifecycle (numbered as Dynamo's backend-common numbers it):

1. Construction: ``Engine(...)`` from code, or ``from_namespace(args)`` from the worker's parsed
   flags (engines also offer ``from_args(argv) -> (engine, WorkerConfig)``, see
   ``dynamo_zmq.worker.from_args``); no heavy work.
2. ``await start(worker_id) -> EngineConfig``: load the model, bind KV-event sockets. Called once.
   Any exception means the engine failed to start: the worker reports it as one
   ``EngineShutdown`` line and exits 1.
3. ``generate(request, ctx)``: any number, concurrently; each yields ``LLMEngineOutput`` chunks
   and ends with exactly one terminal chunk (``finish_reason`` set). ``ctx.is_stopped()`` asks
   it to finish early with ``finish_reason="cancelled"``.
4. ``await abort(ctx)``: optional; the worker calls it when a request is stopped or killed, so
   the engine frees the sequence at once. Default: nothing.
5. ``await drain()``: optional; on shutdown, after the worker unregistered, waited the grace
   period and stopped admitting new requests, while in-flight requests still run (so they can
   be handed off or finished). The worker then waits for them, within its graceful timeout.
   ``load()`` (optional, any time after ``start``): what each data-parallel rank holds now; the
   worker publishes it for routers (see ``dynamo_zmq.load``).
   ``await clear_kv_blocks()`` (optional, any time after ``start``): drop the prefix cache
   (the worker's ``clear_kv_blocks`` endpoint); default: ``errors.Unsupported``.
   ``metrics_collector()`` (optional): the engine's own Prometheus metrics, served on the
   worker's ``/metrics``.
   ``kv_transfer`` (an attribute, set by the worker after ``start`` and before the first
   request of a ``prefill`` or ``decode`` worker; None otherwise): the worker's KV-transfer
   ends (``dynamo_zmq.kv_transfer.KvTransfer``) for an engine with
   ``Capability.DISAGGREGATION``.
   ``await embed(request, ctx) -> list[float]`` (optional, any time after ``start``, any
   number concurrently): the embedding of ``request.token_ids`` (a request whose
   ``embedding`` is set; ``/v1/embeddings`` sends one per input). Engines that embed declare
   ``Capability.EMBEDDINGS``, and ``Capability.EMBEDDINGS_ONLY`` when they cannot also
   generate (``generate`` then refuses with ``InvalidArgument``); ``abort(ctx)`` applies as
   for ``generate``. Default: ``errors.Unsupported``.
6. ``await cleanup()``: release everything. Idempotent, safe before ``start`` and never
   concurrent with it.

Errors (Dynamo's taxonomy, ``dynamo_zmq.errors``): a request the engine cannot run is an error
terminal chunk or ``InvalidArgument``; a request the engine cannot run *because the engine
crashed* must reach the caller as ``EngineShutdown`` (retryable: another worker may serve it;
HTTP 503). An engine reports a crash either by raising ``EngineShutdown`` from ``generate``
(the typed form, preferred) or by declaring itself dead (``dead_reason()`` returns why): from
then on the worker turns any exception or error terminal of ``generate`` into
``EngineShutdown``. What a crash is, per engine: the mocker's scheduler task of a rank dying;
vLLM's ``EngineDeadError`` (its engine-core process gone).

The messages (``PreprocessedRequest``, ``LLMEngineOutput``, ``EngineConfig``...) live in
``_messages``.
"""

from __future__ import annotations

import abc
import argparse
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, ClassVar

from .. import errors
from ..context import Context
from ._live import LiveRequests
from ._messages import EngineConfig, EngineLoad, LLMEngineOutput, PreprocessedRequest

if TYPE_CHECKING:
    from ..kv_transfer import KvTransfer

__all__ = ["LLMEngine"]


class LLMEngine(abc.ABC):
    """An inference engine behind a worker. See the module docstring for the lifecycle."""

    #: Name used by ``--engine NAME`` (engines also register under the
    #: ``dynamo_zmq.engines`` entry-point group).
    name: ClassVar[str] = ""
    #: Whether the engine can do its own pre- and post-processing (tokenizer, chat template,
    #: detokenizer, stop strings): ``--native-framework-processing`` is refused otherwise.
    supports_native_processing: ClassVar[bool] = False
    #: The worker's KV-transfer ends in a disaggregated role (see the module docstring).
    kv_transfer: KvTransfer | None = None

    @classmethod  # noqa: B027 (optional hook)
    def add_args(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        """Add this engine's own command-line flags."""

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> LLMEngine:
        """Build the engine from parsed flags (the worker's and the engine's own). Bad flags or
        model files raise ``errors.InvalidArgument``: the worker prints its message, exits 2."""
        return cls()

    @abc.abstractmethod
    async def start(self, worker_id: int) -> EngineConfig:
        """Load the model and return its configuration. Called once."""

    @abc.abstractmethod
    def generate(
        self, request: PreprocessedRequest, ctx: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        """Stream outputs for one request, ending with exactly one terminal chunk."""

    @property
    def live_requests(self) -> LiveRequests[Any]:
        """The engine's requests in flight by context id: an engine adds each one ``generate``
        or ``embed`` starts (and removes it when it ends), and ``abort`` frees
        ``live_requests.of(ctx.id())``.
        Made on first use, so an engine need not call ``LLMEngine.__init__``."""
        live: LiveRequests[Any] | None = self.__dict__.get("_live_requests")
        if live is None:
            live = self.__dict__["_live_requests"] = LiveRequests()
        return live

    async def abort(self, ctx: Context) -> None:  # noqa: B027 (optional hook)
        """Free the requests of ``ctx`` now (stop or kill reached the worker); an engine finds
        them in ``self.live_requests.of(ctx.id())``."""

    async def drain(self) -> None:  # noqa: B027 (optional hook)
        """Finish or hand off in-flight work; the worker admits nothing new, and in-flight
        requests are still running when this is called."""

    def dead_reason(self) -> str | None:
        """Optional: None while the engine can serve; once it crashed, why (the worker then
        reports failures of ``generate`` as ``EngineShutdown``). Cheap; called only when a
        request fails."""
        return None

    def capabilities(self) -> frozenset[str]:
        """What the engine can do beyond plain generation (``Capability`` names), asked once
        after ``start`` and advertised: frontends refuse requests that need anything else."""
        return frozenset()

    def load(self) -> list[EngineLoad] | None:
        """Optional: what each data-parallel rank holds now, one ``EngineLoad`` per rank (an
        empty list when nothing is known yet). The worker calls it every ``--load-interval``
        from the event loop, so it must be cheap and must not block. None (the default) means
        the engine does not report load: the worker publishes nothing and routers keep their
        own prediction."""
        return None

    def stats(self) -> dict[str, float]:
        """Optional live numbers for metrics and routing, e.g. ``kv_active_blocks``,
        ``kv_total_blocks``, ``num_running``, ``num_waiting``."""
        return {}

    async def clear_kv_blocks(self) -> None:
        """Optional: drop every cached KV block that no running request holds, and publish the
        matching KV events (``BlockRemoved`` / ``AllBlocksCleared``) so routers forget them.
        Dynamo's ``clear_kv_blocks`` endpoint calls it.

        Raises:
            Unsupported: the engine cannot (the default).
            DynamoError: the engine refused or failed (e.g. vLLM with requests running).
        """
        raise errors.Unsupported(f"the {self.name or type(self).__name__} engine cannot clear "
                                 "its KV blocks")

    async def load_lora(self, name: str, path: str) -> None:
        """Optional (engines with ``Capability.LORA``): load the LoRA adapter at ``path`` under
        ``name``, so requests with ``lora_name=name`` use it. All or nothing: on failure the
        engine holds nothing new.

        Raises:
            Unsupported: the engine has no adapters (the default).
            InvalidArgument: a bad path, an adapter that does not fit the model (its rank above
                ``--max-lora-rank``, other target modules), or ``name`` already loaded.
        """
        raise errors.Unsupported(f"the {self.name or type(self).__name__} engine cannot load "
                                 "LoRA adapters")

    async def unload_lora(self, name: str) -> None:
        """Optional: unload adapter ``name``; requests for it are refused from then on.

        Raises:
            Unsupported: the engine has no adapters (the default).
            NotFound: no adapter of that name is loaded.
        """
        raise errors.Unsupported(f"the {self.name or type(self).__name__} engine cannot unload "
                                 "LoRA adapters")

    def lora_adapters(self) -> dict[str, str]:
        """The adapters loaded now, name -> path (advertised with the model). Cheap."""
        return {}

    async def embed(self, request: PreprocessedRequest, ctx: Context) -> list[float]:
        """Optional: the embedding of ``request.token_ids`` (``request.embedding`` holds the
        options). A stopped or killed ``ctx`` may end it with ``errors.Cancelled``.

        Raises:
            Unsupported: the engine cannot embed (the default).
            InvalidArgument: the engine refused the request (e.g. ``dimensions``).
        """
        raise errors.Unsupported(f"the {self.name or type(self).__name__} engine cannot embed")

    def metrics_collector(self) -> Any:
        """Optional: a prometheus_client collector (an object with ``collect()``) of the engine's
        own metrics, which the worker serves on its ``/metrics`` beside its own. None (the
        default): none."""
        return None

    @abc.abstractmethod
    async def cleanup(self) -> None:
        """Release everything. Idempotent; safe before ``start``."""
