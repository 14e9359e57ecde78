"""Processes that could outlive a killed worker (issue 20 item 6): a mocker worker, serving
through a frontend, starts no child process at all (only vLLM's engine does, and its engine
core ends with its worker: tests/test_vllm_engine_process.py)."""

from __future__ import annotations

from tests.support.churn import frontend, wait_live, worker
from tests.support.procs import children


async def test_a_serving_mocker_worker_has_no_child_processes(
    namespace, spawn, tiny_model
):
    proc = worker(spawn, namespace, tiny_model)
    front = frontend(spawn, namespace)
    await wait_live(front.address, lambda live: live == {f"{proc.instance_id:x}"})
    assert children(proc.pid) == []
