"""The Responses API's in-memory store (``_responses_store.py``) on its own: a response is
forgotten after its TTL (the clock patched, no waiting), and a store that is off refuses
``previous_response_id`` with 400. Size eviction and the 404s are shown through a real frontend
in tests/test_responses_api.py."""

from __future__ import annotations

import pytest

from dynamo_zmq.frontend import _responses_store
from dynamo_zmq.frontend.errors import HttpError


def test_the_store_forgets_a_response_after_its_ttl(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(_responses_store.time, "monotonic", lambda: now[0])
    store = _responses_store.ResponsesStore(size=10, ttl=60)
    store.put({"id": "resp_a"}, [{"role": "user", "content": "a"}])
    now[0] += 59
    assert store.get("resp_a") == {"id": "resp_a"}
    assert store.conversation("resp_a") == [{"role": "user", "content": "a"}]
    now[0] += 2
    for look in (store.get, store.conversation):
        with pytest.raises(HttpError) as info:
            look("resp_a")
        assert info.value.status == 404
    off = _responses_store.ResponsesStore(size=0)
    off.put({"id": "resp_b"}, [])
    with pytest.raises(HttpError) as info:
        off.conversation("resp_b")
    assert info.value.status == 400 and info.value.param == "previous_response_id"
