"""The messages of the engine contract: the request an engine runs (``PreprocessedRequest`` and
its option groups), the chunks it yields (``LLMEngineOutput``), what it reports at start
(``EngineConfig``) and per data-parallel rank (``EngineLoad``), and how streams end
(``FinishReason``, terminal helpers).

All are msgspec Structs that cross the wire as plain MessagePack maps; new fields go last, with
defaults, so older peers still decode them (docs/wire.md lists them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from ._block_hashing import KvHashScheme
from ._handoff import Disaggregation, KvHandoff

__all__ = [
    "EmbeddingOptions",
    "EngineConfig",
    "EngineLoad",
    "FinishReason",
    "GuidedDecoding",
    "LLMEngineOutput",
    "MediaItem",
    "OutputOptions",
    "PreprocessedRequest",
    "Resume",
    "RoutingHints",
    "SamplingOptions",
    "StopConditions",
    "ToolCallDelta",
    "ToolOptions",
    "Usage",
    "cancelled_output",
    "error_output",
    "length_output",
    "stop_output",
]


class FinishReason:
    """Why a stream ended (``LLMEngineOutput.finish_reason``).

    An engine's terminal uses one of ``ALL`` (the backend-common contract): ``stop`` for an
    end-of-sequence token, a stop token or a stop string alike. The worker's post-processing
    (the request-flow document's decoder) then tells them apart, as Dynamo's ``FinishReason``
    does: ``EOS`` when the model's end-of-sequence token ended the sequence, ``stop`` with
    ``stop_reason`` naming the stop string or stop token id that matched. docs/operations.md,
    "Finish reasons", has the table of what each becomes in OpenAI responses.
    """

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"
    #: The end-of-sequence token ended the sequence (set by the worker, not by engines).
    EOS = "eos"
    #: The sequence ended normally (``eos`` or ``stop``) after the worker's tool-call parsing
    #: found at least one tool call (set by the worker, not by engines).
    TOOL_CALLS = "tool_calls"

    #: What an engine's terminal may carry (``EOS`` is the worker's).
    ALL = frozenset({STOP, LENGTH, CANCELLED, ERROR})


_WIRE = {"omit_defaults": True, "forbid_unknown_fields": False}
#: A prompt token id: tokenizers and engines take 32-bit unsigned ids, so one outside that
#: range is refused when the request is decoded (InvalidArgument), not deep in an engine.
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]


class SamplingOptions(msgspec.Struct, **_WIRE):
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int = 1
    #: Additive biases of the logits of token ids (OpenAI's ``logit_bias``; engines with
    #: ``Capability.LOGIT_BIAS``). None: no bias.
    logit_bias: dict[int, float] | None = None


class StopConditions(msgspec.Struct, **_WIRE):
    max_tokens: int | None = None
    min_tokens: int = 0
    #: Stop strings (applied by the worker's post-processing, not the engine).
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False


class OutputOptions(msgspec.Struct, **_WIRE):
    logprobs: int | None = None
    #: Log-probabilities of the prompt tokens with this many top alternatives each
    #: (``Capability.PROMPT_LOGPROBS``; ``LLMEngineOutput.prompt_logprobs``); None: none.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    #: Ask the engine for text itself (native processing); otherwise the worker detokenizes.
    detokenize: bool = False


class RoutingHints(msgspec.Struct, **_WIRE):
    #: Data-parallel rank the router chose inside the worker.
    dp_rank: int | None = None
    #: Blocks of the prompt the router expects to be cached there (informational).
    overlap_blocks: int | None = None


class Resume(msgspec.Struct, **_WIRE):
    """A migrated request's continuation (``PreprocessedRequest.resume``): the last
    ``generated`` prompt tokens are output the client already has, streamed by a worker that
    was lost. The worker's post-processing replays them without emitting their text (what the
    lost worker still held back, a partial stop string or character, comes out with the new
    tokens) and reports usage as for the original request."""

    #: Trailing prompt tokens that are output already streamed.
    generated: Annotated[int, msgspec.Meta(ge=0)] = 0
    #: The original request's ``stop.min_tokens`` (the wire's is what is left of it, for the
    #: engine; stop strings apply after the original count).
    min_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0


class GuidedDecoding(msgspec.Struct, **_WIRE):
    """Constrained decoding (``PreprocessedRequest.guided``; engines with
    ``Capability.STRUCTURED_OUTPUTS``): exactly one kind is set."""

    #: A JSON schema the output must validate against.
    json_schema: dict[str, Any] | None = None
    #: Any JSON object (``response_format: json_object``).
    json_object: bool = False
    #: A regular expression the whole output must match.
    regex: str | None = None
    #: The output must be exactly one of these strings.
    choice: list[str] | None = None
    #: A context-free grammar (EBNF, as vLLM's ``guided_grammar`` takes it).
    grammar: str | None = None


class EmbeddingOptions(msgspec.Struct, **_WIRE):
    """Set on a request that asks for the embedding of its tokens instead of a generation
    (``PreprocessedRequest.embedding``; engines with ``Capability.EMBEDDINGS``)."""

    #: Output dimensions of a matryoshka model (``Capability.EMBEDDING_DIMENSIONS``); None:
    #: the model's own.
    dimensions: Annotated[int, msgspec.Meta(ge=1)] | None = None
class ToolOptions(msgspec.Struct, **_WIRE):
    """Tool calling for one request (``PreprocessedRequest.tools``): the worker parses tool
    calls out of the output (the family parser of ``--tool-call-parser`` for ``auto``; the
    constrained JSON itself for ``required`` and ``function``)."""

    #: ``auto``, ``required`` (a JSON array of ``{name, parameters}``) or ``function`` (the
    #: named function's arguments object).
    choice: str = "auto"
    #: The function's name, with ``choice == "function"``.
    function: str | None = None
    #: False (``parallel_tool_calls: false``) with ``auto``: only the first call goes out, the
    #: deltas of later ones are dropped (``required`` limits the array to one instead).
    parallel: bool = True


class MediaItem(msgspec.Struct, **_WIRE):
    """One image of a request (``PreprocessedRequest.media``), in the order of its placeholder
    run in ``token_ids``.

    ``token_ids`` holds the image as ``length`` copies of the model's image placeholder token
    starting at ``offset``: the frontend expands each image to the count the engine advertises
    (``EngineConfig.tokens_per_image``), so block hashes, routing and the engine all see the same
    positions. ``mm_hash`` (xxh3-64 of ``data``, hex) salts the hash of every KV block the run
    overlaps, so the same image reuses a worker's cache and a different one does not.
    """

    #: The encoded image as the client sent it (PNG, JPEG, ...), decoded from its data URL or
    #: fetched from an allowed domain.
    data: bytes
    mm_hash: str
    offset: int
    length: int
    kind: str = "image"


class PreprocessedRequest(msgspec.Struct, **_WIRE):
    """A tokenized request, as the frontend sends it to a worker."""

    token_ids: list[TokenId]
    model: str = ""
    request_id: str = ""
    sampling: SamplingOptions = msgspec.field(default_factory=SamplingOptions)
    stop: StopConditions = msgspec.field(default_factory=StopConditions)
    output: OutputOptions = msgspec.field(default_factory=OutputOptions)
    routing: RoutingHints = msgspec.field(default_factory=RoutingHints)
    #: End-of-sequence token ids of the model (the frontend knows them from the model card).
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    #: The request's part in disaggregated serving: ``DecodeRemotely`` (to a prefill worker)
    #: or ``PrefillRemotely`` with the handoff (to a decode worker); None: aggregated.
    disaggregation: Disaggregation | None = None
    annotations: list[str] = msgspec.field(default_factory=list)
    #: Checksum of the model card the request was preprocessed with (the request-flow
    #: document's ``BackendInput.mdcsum``); a worker serving another card refuses it. None: not
    #: checked (callers of the runtime API that build requests themselves).
    mdcsum: str | None = None
    #: Set on a migrated request (the frontend's migration): how much of ``token_ids`` is
    #: output already streamed. ``stop.max_tokens`` and ``stop.min_tokens`` are then what is
    #: left of the original budget, counted from the extended prompt as usual.
    resume: Resume | None = None
    #: Constrained decoding (structured outputs); None: free generation.
    guided: GuidedDecoding | None = None
    #: Set: embed ``token_ids`` (``LLMEngine.embed``) instead of generating; the one output
    #: is a terminal whose ``embedding`` is the vector.
    embedding: EmbeddingOptions | None = None
    #: Tool calling (None: the request has no tools, or ``tool_choice`` is ``none``).
    tools: ToolOptions | None = None
    #: Split reasoning text out of the output (the worker's ``--reasoning-parser``, if any).
    reasoning: bool = False
    #: The ``traceparent`` of this request's predecessor's ``engine.generate`` span (a
    #: migrated request's lost worker, a disaggregated decode's prefill), which this request's
    #: span links to; set by the frontend with tracing on (docs/observability.md).
    migration_link: str | None = None
    #: The LoRA adapter to generate with (its name as loaded on the worker); None: the base
    #: model. A worker that does not hold it refuses the request (``NotFound``).
    lora_name: str | None = None
    #: Scheduling priority (vLLM's convention: lower runs first; 0 is the default). Engines
    #: with ``Capability.PRIORITY`` schedule by it; routers order their waiting queue by it.
    priority: int = 0
    #: Images of the request (``Capability.VISION`` engines only), in prompt order.
    media: list[MediaItem] | None = None


class Usage(msgspec.Struct, **_WIRE):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None


class ToolCallDelta(msgspec.Struct, **_WIRE):
    """A piece of one tool call (``LLMEngineOutput.tool_calls``), as OpenAI streams them: the
    call's first delta has ``id`` and ``name``; its ``arguments`` pieces, concatenated, are the
    arguments as a JSON object string."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class LLMEngineOutput(msgspec.Struct, **_WIRE):
    """One chunk of a generation: new token ids, optional text, and on the last chunk the reason."""

    token_ids: list[int] = msgspec.field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    #: Error message when ``finish_reason == "error"``.
    error: str | None = None
    log_probs: list[float] | None = None
    #: With ``finish_reason == "stop"``: the stop string (str) or stop token id (int) that
    #: ended the stream, as vLLM reports it; None for an end-of-sequence token or unknown.
    stop_reason: int | str | None = None
    #: With ``log_probs`` and ``request.output.logprobs = k > 0``: per token of the chunk, the
    #: engine's top ``k`` alternatives as ``(token id, logprob)`` pairs, most likely first.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    #: Set by the worker's post-processing with ``log_probs``: per token of the chunk, its
    #: text (as vLLM's server shows it) followed by the text of each ``top_logprobs`` entry.
    logprob_texts: list[list[str]] | None = None
    #: With ``request.output.prompt_logprobs``, on one chunk (the first): per prompt token,
    #: ``(token id, logprob, rank)`` of the prompt token itself, then of the engine's top
    #: alternatives by rank (the prompt token not repeated); the first token's list is empty
    #: (nothing precedes it).
    prompt_logprobs: list[list[tuple[int, float, int]]] | None = None
    #: Set by the worker's post-processing with ``prompt_logprobs``: per prompt token, the
    #: texts of its entries (the first token's: its own text), as vLLM's server shows them.
    prompt_logprob_texts: list[list[str]] | None = None
    #: The embedding, on the terminal of an embedding request (``PreprocessedRequest.embedding``).
    embedding: list[float] | None = None
    #: Tool-call pieces the worker's tool-call parsing found in this chunk's text.
    tool_calls: list[ToolCallDelta] | None = None
    #: Reasoning text the worker's reasoning parser moved out of ``text``.
    reasoning: str | None = None
    #: On a prefill worker's terminal (``DecodeRemotely``): where the prompt's KV waits for
    #: the decode worker's pull; None: nothing was handed off.
    kv_handoff: KvHandoff | None = None
    #: With tracing on, on the worker's first output with tokens: the ``traceparent`` of its
    #: ``engine.generate`` span (what a migration or a disaggregated decode links to).
    worker_trace_link: str | None = None

    @property
    def is_terminal(self) -> bool:
        return self.finish_reason is not None


class EngineConfig(msgspec.Struct, **_WIRE):
    """What an engine tells the worker (and through it, routers and frontends) after start."""

    model_name: str
    served_model_name: str = ""
    context_length: int = 0
    kv_block_size: int = 0
    total_kv_blocks: int = 0
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    data_parallel_size: int = 1
    data_parallel_start_rank: int = 0
    #: ZMQ PUB endpoint of the engine's KV events (vLLM format), if it publishes them.
    kv_events_endpoint: str | None = None
    #: ZMQ ROUTER endpoint answering replay requests for missed KV-event batches.
    kv_replay_endpoint: str | None = None
    extra: dict[str, Any] = msgspec.field(default_factory=dict)
    #: The scheme of the ``own_hashes`` its KV events carry (``KvHashScheme.ours``), if any.
    kv_hash_scheme: KvHashScheme | None = None
    #: With ``Capability.VISION``: the token id the frontend writes for each position of an
    #: image (``MediaItem``), and how many positions one image takes.
    image_token_id: int | None = None
    tokens_per_image: int = 0


_Count = Annotated[int, msgspec.Meta(ge=0)]


class EngineLoad(msgspec.Struct, array_like=True, gc=False):
    """What one data-parallel rank of an engine holds now (``LLMEngine.load``). It travels in
    the worker's load reports (``dynamo_zmq.load``): new fields go last, with defaults."""

    dp_rank: _Count
    #: KV blocks held by running requests (cached but unreferenced blocks do not count).
    active_blocks: _Count
    #: KV blocks of this rank in all (0: unknown).
    total_blocks: _Count = 0
    num_running: _Count = 0
    num_waiting: _Count = 0


def stop_output(usage: Usage | None = None, token_ids: Sequence[int] = ()) -> LLMEngineOutput:
    return LLMEngineOutput(list(token_ids), finish_reason=FinishReason.STOP, usage=usage)


def length_output(usage: Usage | None = None, token_ids: Sequence[int] = ()) -> LLMEngineOutput:
    return LLMEngineOutput(list(token_ids), finish_reason=FinishReason.LENGTH, usage=usage)


def cancelled_output(usage: Usage | None = None) -> LLMEngineOutput:
    return LLMEngineOutput(finish_reason=FinishReason.CANCELLED, usage=usage)


def error_output(message: str, usage: Usage | None = None) -> LLMEngineOutput:
    return LLMEngineOutput(finish_reason=FinishReason.ERROR, error=message, usage=usage)
