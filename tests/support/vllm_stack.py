"""One vLLM worker and a frontend on a namespace of their own, for the vLLM test modules
(``with vllm_stack(model_dir) as stack: ...``); the processes stop when the block ends. Also the
vLLM settings those modules share: its environment on this CPU, the worker flags and the engine
arguments for the tiny model."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.http_calls import get
from tests.support.procs import Proc

__all__ = ["ENGINE_ARGS", "MAX_MODEL_LEN", "VLLM_ENV", "WORKER_FLAGS", "WORKER_START", "VllmStack",
           "use_vllm_env", "vllm_stack", "wait_listed", "wait_models"]

#: vLLM on this CPU: in-process engine core, 1 GiB of KV cache, logs on stderr.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
MAX_MODEL_LEN = 512
WORKER_FLAGS = ("--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32")
#: ``WORKER_FLAGS`` as engine arguments, for a ``VllmEngine`` run in the test process.
ENGINE_ARGS: dict[str, Any] = {"max_model_len": MAX_MODEL_LEN, "dtype": "float32"}
#: Seconds a vLLM worker process may take to load (import + model + KV cache) on a busy CI box.
WORKER_START = 240


def use_vllm_env() -> None:
    """Set ``VLLM_ENV`` in this process's environment (what is set already stays), for vLLM
    engines run in the test process."""
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)


@dataclass(frozen=True)
class VllmStack:
    namespace: str
    worker: Proc
    frontend: Proc

    @property
    def url(self) -> str:
        """The frontend's base URL."""
        return self.frontend.address


@contextmanager
def vllm_stack(
    model_dir: str | Path, model_name: str = "tiny", worker_flags: tuple[str, ...] = ()
) -> Iterator[VllmStack]:
    """Start a vLLM worker serving ``model_dir`` as ``model_name`` (``worker_flags`` added to
    the usual ones) and a frontend, both on a fresh namespace; stop both at the end."""
    namespace = f"t{uuid.uuid4().hex[:12]}"
    procs: list[Proc] = []
    try:
        worker = Proc(["-m", "dynamo_zmq.worker", "--engine", "vllm", "--model-path",
                       str(model_dir), "--model-name", model_name, "--namespace", namespace,
                       "--host", "127.0.0.1", *WORKER_FLAGS, *worker_flags], env=VLLM_ENV)
        procs.append(worker)
        front = Proc(["-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace", namespace])
        procs.append(front)
        worker.wait_ready(WORKER_START)
        front.wait_ready(60)
        yield VllmStack(namespace, worker, front)
    finally:
        for proc in procs:
            proc.stop()


def wait_listed(url: str, names: tuple[str, ...] = ("tiny",), timeout: float = 60.0) -> None:
    """Wait until the frontend at ``url`` lists every model of ``names``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            status, body = get(f"{url}/v1/models")
            if status == 200 and set(names) <= {m["id"] for m in json.loads(body)["data"]}:
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"models {names} never listed"
        time.sleep(0.2)


async def wait_models(url: str, timeout: float = 60.0, names: tuple[str, ...] = ("tiny",)) -> None:
    """``wait_listed`` from async code."""
    await asyncio.to_thread(wait_listed, url, names, timeout)
