"""The disaggregation handoff on the wire (``dynamo_zmq/llm/_handoff.py``): every typed handoff
round-trips through MessagePack inside a request and an output, and a malformed one is refused
whole (InvalidArgument at the worker), never half-read."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynamo_zmq import errors
from dynamo_zmq.context import Context
from dynamo_zmq.kv_transfer import Ticket
from dynamo_zmq.llm import (
    ConnectorHandoff,
    DecodeRemotely,
    LLMEngineOutput,
    PrefillRemotely,
    PreprocessedRequest,
)
from dynamo_zmq.runtime._handlers import adapt_handler
from engines.vllm._kv_params import handoff_of, kv_transfer_params, params_of

_text = st.text(min_size=1, max_size=40)
_count = st.integers(min_value=0, max_value=2**40)

tickets = st.builds(
    Ticket, transfer_endpoint=_text, transfer_id=_text, num_blocks=_count, num_bytes=_count,
    transfer_key=st.none() | _text,
)
connector_handoffs = st.builds(
    ConnectorHandoff, engine_id=_text, request_id=_text, host=_text,
    port=st.integers(min_value=1, max_value=65535), block_ids=st.lists(_count, max_size=20),
    num_tokens=_count, prompt_hash=_text, curve_key=st.none() | _text,
)
handoffs = tickets | connector_handoffs
roles = st.just(DecodeRemotely()) | st.builds(PrefillRemotely, handoff=st.none() | handoffs)


@given(role=st.none() | roles, handoff=st.none() | handoffs)
def test_every_handoff_round_trips_in_a_request_and_an_output(role, handoff):
    request = PreprocessedRequest(token_ids=[1, 2], disaggregation=role)
    wire = msgspec.msgpack.encode(request)
    assert msgspec.msgpack.decode(wire, type=PreprocessedRequest) == request
    output = LLMEngineOutput([3], finish_reason="length", kv_handoff=handoff)
    wire = msgspec.msgpack.encode(output)
    assert msgspec.msgpack.decode(wire, type=LLMEngineOutput) == output


@given(handoff=connector_handoffs)
def test_a_connector_handoff_round_trips_through_vllms_parameters(handoff):
    params = kv_transfer_params(PrefillRemotely(handoff))
    assert params is not None and params["do_remote_prefill"] is True
    assert handoff_of(params) == handoff
    assert handoff_of(params_of(handoff)) == handoff


def test_vllm_gets_no_parameters_for_another_engines_handoff():
    ticket = Ticket(transfer_endpoint="tcp://h:1", transfer_id="t", num_blocks=1, num_bytes=1)
    assert kv_transfer_params(PrefillRemotely(ticket)) is None
    assert kv_transfer_params(DecodeRemotely()) == {"do_remote_decode": True}


@pytest.mark.parametrize("disaggregation", [
    {"type": "prefill_remotely_typo"},
    {"type": "prefill_remotely", "handoff": {"type": "transfer", "transfer_id": "x"}},
    {"type": "prefill_remotely", "handoff": {"type": "connector", "host": "h", "port": 0,
                                             "engine_id": "e", "request_id": "r",
                                             "block_ids": [], "num_tokens": 1,
                                             "prompt_hash": "p"}},
    {"do_remote_prefill": True},  # version 1's untyped map
])
def test_a_malformed_handoff_fails_the_request_typed(disaggregation):
    serve = adapt_handler(lambda request: None, PreprocessedRequest)
    payload = msgspec.msgpack.encode({"token_ids": [1], "disaggregation": disaggregation})
    with pytest.raises(errors.InvalidArgument):
        serve(msgspec.Raw(payload), Context("malformed-handoff"))
