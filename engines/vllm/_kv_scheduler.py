"""Scheduler side of ``DynamoZmqConnector``: which requests pull KV from a prefill worker, which
keep their blocks for a decode worker to pull, and the handoff a prefill returns.

Runs in vLLM's engine-core process, inside its scheduler (one thread); its decisions reach the
worker side (``_kv_worker.py``) as ``ZmqConnectorMetadata``, once per engine step.
"""

from __future__ import annotations

import hashlib
import logging
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from dynamo_zmq.llm import ConnectorHandoff

from ._kv_params import handoff_of, mark_pulled, params_of, wants_handoff

__all__ = ["PullJob", "SchedulerSide", "ZmqConnectorMetadata", "prompt_hash"]

#: Under "vllm": logs of vLLM's engine-core process reach stderr through vLLM's handler.
log = logging.getLogger("vllm.dynamo_zmq.kv")

@dataclass(frozen=True)
class PullJob:
    """One request's KV to pull: ``pairs`` of (local block, remote block); empty pairs only
    release the remote blocks (the prompt was all in the local prefix cache)."""

    req_id: str
    host: str
    port: int
    remote_req_id: str
    pairs: list[tuple[int, int]]
    #: The prefill engine's CURVE public key (z85), when it serves with auth on.
    curve_key: str | None = None


@dataclass
class ZmqConnectorMetadata(KVConnectorMetadata):
    """One engine step's orders from the scheduler side to the worker side."""

    #: Requests whose KV to pull now (the request waits in WAITING_FOR_REMOTE_KVS).
    pulls: list[PullJob] = field(default_factory=list)
    #: Finished prefills whose blocks wait for a pull: request id -> (block ids, deadline on
    #: ``time.monotonic()``), after which the worker side frees them.
    sends: dict[str, tuple[list[int], float]] = field(default_factory=dict)


def prompt_hash(tokens: Any, n: int) -> str:
    """A digest of the first ``n`` prompt tokens: a decode engine pulls only KV computed for
    the prompt it serves."""
    return hashlib.blake2b(array("q", list(tokens)[:n]).tobytes(), digest_size=16).hexdigest()


class SchedulerSide:
    """The connector's scheduler-role half (see the module docstring)."""

    def __init__(self, engine_id: str, host: str, port: int, block_size: int, ttl: float,
                 curve_key: str | None = None) -> None:
        self.engine_id = engine_id
        #: This engine's CURVE public key (z85; None: auth off), for decode engines to check.
        self.curve_key = curve_key
        self.host, self.port = host, port
        self.block_size = block_size
        #: Seconds a finished prefill's blocks wait for their pull before they are freed.
        self.ttl = ttl
        self._meta = ZmqConnectorMetadata()

    def get_num_new_matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        """A decode request with a handoff loads the prompt's tokens the local prefix cache
        lacks, asynchronously (between engine steps)."""
        handoff = handoff_of(request.kv_transfer_params)
        if handoff is None:
            return 0, False
        remote = min(handoff.num_tokens, request.num_prompt_tokens)
        count = remote - num_computed
        if count <= 0:
            return 0, False
        if handoff.prompt_hash != prompt_hash(request.prompt_token_ids or (), remote):
            log.warning("request %s: the handoff's KV is not for this prompt: prefilling locally",
                        request.request_id)
            return 0, False  # update_state_after_alloc then only releases the remote blocks
        return count, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        """Order the pull of a decode request's blocks (once: the handoff is then marked used)."""
        params = request.kv_transfer_params
        handoff = handoff_of(params)
        if handoff is None:
            return
        pairs: list[tuple[int, int]] = []
        if num_external > 0:
            group = blocks.blocks[0]
            local = [b.block_id for b in group]
            remote = handoff.block_ids
            # Local prefix-cache hits are whole (hashed) blocks at the start; the new blocks are
            # not hashed until the load is done: pull from the first new block up to the last
            # block the remote tokens fill.
            first = sum(b.block_hash is not None and not b.is_null for b in group)
            end = -(-(first * self.block_size + num_external) // self.block_size)
            end = min(end, len(local), len(remote))
            pairs = [(local[i], remote[i]) for i in range(first, end)]
        self._add_pull(request.request_id, params, handoff, pairs)

    def _add_pull(self, req_id: str, params: dict[str, Any], handoff: ConnectorHandoff,
                  pairs: list[tuple[int, int]]) -> None:
        self._meta.pulls.append(PullJob(
            req_id, handoff.host, handoff.port, handoff.request_id, pairs,
            handoff.curve_key or None,
        ))
        mark_pulled(params)

    def build_connector_meta(self, scheduler_output: Any) -> ZmqConnectorMetadata:
        """This step's orders; starts collecting the next step's."""
        meta, self._meta = self._meta, ZmqConnectorMetadata()
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any]
                                                                           | None]:
        """A finished prefill (``do_remote_decode``) keeps its blocks for ``ttl`` seconds and
        returns the handoff; a decode request that ends before its pull was ordered releases
        the remote blocks."""
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        handoff = handoff_of(params)
        if handoff is not None:  # aborted before it was scheduled
            self._add_pull(request.request_id, params, handoff, [])
            return False, None
        if not wants_handoff(params):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                  RequestStatus.FINISHED_STOPPED) or not block_ids:
            return False, None
        self._meta.sends[request.request_id] = (list(block_ids), time.monotonic() + self.ttl)
        computed = int(request.num_computed_tokens)
        return True, params_of(ConnectorHandoff(
            engine_id=self.engine_id, request_id=request.request_id, host=self.host,
            port=self.port, block_ids=list(block_ids), num_tokens=computed,
            prompt_hash=prompt_hash(request.prompt_token_ids or (), computed),
            curve_key=self.curve_key or None,
        ))
