"""What an engine can do beyond plain generation, advertised so that frontends refuse what the
serving engine cannot do instead of ignoring it.

An engine names its capabilities in ``LLMEngine.capabilities()``; the worker advertises them
with the engine's name (``ModelAdvert.engine_name`` and ``.capabilities``). A frontend checks a
request against its model's advert and answers 400 naming the engine and the parameter
(``dynamo_zmq.frontend.errors.engine_lacks``).
"""

from __future__ import annotations

__all__ = ["Capability"]


class Capability:
    """Names of engine capabilities (strings on the wire; unknown names are kept, not refused)."""

    #: Constrained decoding: ``PreprocessedRequest.guided`` (``response_format``, ``guided_*``,
    #: and ``tool_choice`` ``required`` or a named function).
    STRUCTURED_OUTPUTS = "structured_outputs"
    #: Log-probabilities of the sampled tokens and the top alternatives
    #: (``OutputOptions.logprobs``; ``LLMEngineOutput.log_probs``).
    LOGPROBS = "logprobs"
    #: Log-probabilities of the prompt tokens (``echo`` with ``logprobs``, ``prompt_logprobs``).
    PROMPT_LOGPROBS = "prompt_logprobs"
    #: Additive logit biases per token id (``SamplingOptions.logit_bias``).
    LOGIT_BIAS = "logit_bias"
    #: Embeddings (``/v1/embeddings``) instead of, or beside, generation.
    EMBEDDINGS = "embeddings"
    #: The engine embeds and cannot generate (vLLM's pooling runner): the frontend answers
    #: chat and completion requests for the model with 400 naming it.
    EMBEDDINGS_ONLY = "embeddings_only"
    #: ``dimensions`` of ``/v1/embeddings`` (a matryoshka model: truncated and renormalised).
    EMBEDDING_DIMENSIONS = "embedding_dimensions"
    #: Disaggregated serving: as a prefill worker the engine offers a prompt's KV
    #: (``disaggregation=DecodeRemotely()``) and returns the handoff (``kv_handoff``); as a
    #: decode worker it pulls it (``PrefillRemotely(handoff)``). A worker started with
    #: ``--disaggregation-mode prefill|decode`` refuses to start without it.
    DISAGGREGATION = "disaggregation"
    #: With ``DISAGGREGATION``: the engine moves KV between workers itself (vLLM through its
    #: KV connector), so the worker starts no transfer service of its own; the engine reads
    #: the ``--kv-transfer-*`` flags it needs from the worker's arguments.
    OWN_KV_TRANSFER = "own_kv_transfer"
    #: LoRA adapters: ``PreprocessedRequest.lora_name`` selects one, and the engine loads and
    #: unloads them at run time (``LLMEngine.load_lora`` / ``unload_lora``).
    LORA = "lora"
    #: Priority scheduling (``PreprocessedRequest.priority``; vLLM's ``--scheduling-policy
    #: priority``).
    PRIORITY = "priority"
    #: Images (``PreprocessedRequest.media``): the engine takes ``image_url`` content parts; it
    #: advertises ``EngineConfig.image_token_id`` and ``tokens_per_image``.
    VISION = "vision"
