"""The boundary between the typed disaggregation handoff (``dynamo_zmq.llm.Disaggregation``,
``ConnectorHandoff``) and vLLM's ``kv_transfer_params``.

vLLM takes a request's KV-transfer parameters as a dict and reads some of its keys itself (its
scheduler and output processor look at ``do_remote_prefill``), so the dict keeps vLLM's
NixlConnector names: ``do_remote_decode``, ``do_remote_prefill`` and the handoff's fields with a
``remote_`` prefix. This module is the one place that knows them; the rest of the adapter and
the whole of dynamo-zmq see the Structs.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from dynamo_zmq.llm import ConnectorHandoff, DecodeRemotely, Disaggregation

__all__ = ["handoff_of", "kv_transfer_params", "mark_pulled", "params_of", "wants_handoff"]

log = logging.getLogger(__name__)

_FIELDS = ConnectorHandoff.__struct_fields__


def kv_transfer_params(role: Disaggregation) -> dict[str, Any] | None:
    """vLLM's parameters for a request's part in disaggregated serving. None: a decode whose
    handoff is not a connector's (another engine's KV): it prefills locally."""
    if isinstance(role, DecodeRemotely):
        return {"do_remote_decode": True}
    if not isinstance(role.handoff, ConnectorHandoff):
        log.warning("a %s handoff cannot be pulled by vLLM's connector: prefilling locally",
                    type(role.handoff).__name__)
        return None
    return params_of(role.handoff)


def params_of(handoff: ConnectorHandoff) -> dict[str, Any]:
    """The handoff as vLLM's parameters of the decode request that pulls it."""
    params: dict[str, Any] = {"do_remote_prefill": True, "do_remote_decode": False}
    for name in _FIELDS:
        value = getattr(handoff, name)
        if value is not None:
            params["remote_" + name] = value
    return params


def handoff_of(params: dict[str, Any] | None) -> ConnectorHandoff | None:
    """The handoff a decode request's parameters still hold to pull (None: none, already
    pulled, or incomplete)."""
    if not params or not params.get("do_remote_prefill"):
        return None
    fields = {name: params["remote_" + name] for name in _FIELDS if "remote_" + name in params}
    try:
        return msgspec.convert(fields, ConnectorHandoff)
    except msgspec.ValidationError:
        return None


def wants_handoff(params: dict[str, Any] | None) -> bool:
    """A prefill request (``DecodeRemotely``): keep its blocks and return a handoff."""
    return params is not None and bool(params.get("do_remote_decode"))


def mark_pulled(params: dict[str, Any]) -> None:
    """One transfer per request: the handoff is not pulled again (vLLM reads the flag too)."""
    params["do_remote_prefill"] = False
