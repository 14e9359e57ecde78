"""The disaggregation handoff: what a request asks of a prefill or decode worker
(``PreprocessedRequest.disaggregation``) and where a prefill's KV waits for its pull
(``LLMEngineOutput.kv_handoff``).

Each is a tagged msgspec Struct (a map with a ``type`` key on the wire), so a worker decodes
exactly one of a known set, and an unknown or malformed one fails the request's decoding with
InvalidArgument instead of being half-read. docs/disaggregation.md has the flow; docs/wire.md
the fields.
"""

from __future__ import annotations

from typing import Annotated, TypeAlias

import msgspec

from ..kv_transfer import Ticket

__all__ = [
    "ConnectorHandoff",
    "DecodeRemotely",
    "Disaggregation",
    "KvHandoff",
    "PrefillRemotely",
]

_WIRE = {"omit_defaults": True, "forbid_unknown_fields": False, "tag_field": "type"}
_Count = Annotated[int, msgspec.Meta(ge=0)]


class ConnectorHandoff(msgspec.Struct, tag="connector", kw_only=True, **_WIRE):
    """A prefill's KV held by a vLLM engine's KV connector (``engines/vllm/_kv_connector.py``):
    the decode engine's connector pulls ``block_ids`` from ``host``:``port``.

    The fields are vLLM's NixlConnector handoff's, without its ``remote_`` prefix."""

    #: The prefill engine's id and its request's id there (what the pull names).
    engine_id: str
    request_id: str
    host: str
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    block_ids: list[_Count]
    #: Prompt tokens the blocks hold, and a digest of them (``_kv_scheduler.prompt_hash``): a
    #: decode engine pulls only KV computed for the prompt it serves.
    num_tokens: _Count
    prompt_hash: str
    #: The prefill engine's CURVE public key (Z85) when it serves with auth keys.
    curve_key: str | None = None


#: Where a prefill's KV waits: the brokerless transfer's ticket (``kv_transfer``, the mocker's)
#: or a vLLM connector's handoff.
KvHandoff: TypeAlias = Ticket | ConnectorHandoff


class DecodeRemotely(msgspec.Struct, tag="decode_remotely", **_WIRE):
    """To a prefill worker: compute the prompt's KV and keep it for a decode worker to pull;
    the terminal output carries the handoff (``LLMEngineOutput.kv_handoff``)."""


class PrefillRemotely(msgspec.Struct, tag="prefill_remotely", **_WIRE):
    """To a decode worker: a prefill worker computed the prompt's KV; pull it as ``handoff``
    says before generating."""

    #: None: nothing to pull (the prefill handed nothing off): the decode worker prefills.
    handoff: KvHandoff | None = None


#: A request's part in disaggregated serving (None on ``PreprocessedRequest``: aggregated).
Disaggregation: TypeAlias = DecodeRemotely | PrefillRemotely
