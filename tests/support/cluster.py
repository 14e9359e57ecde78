"""Multi-host tests: ``dynamo_zmq.tools.netns`` set up for this checkout, plus helpers.

``cluster("a", "b", ...)`` is a context manager yielding a ``Cluster`` whose processes import
this checkout (PYTHONPATH, cwd), with no ``DYN_*`` variable (not even the loopback pin of
conftest): zero configuration. It skips the test where namespaces cannot be made (not root,
no ``ip``), except under ``CI=true``, where that is a failure.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from dynamo_zmq.tools.child_process import ChildProcess
from dynamo_zmq.tools.netns import Cluster, Host, cluster_supported
from tests.support.procs import ROOT, pythonpath

__all__ = [
    "Cluster",
    "Host",
    "cluster",
    "complete",
    "frontend",
    "mocker_worker",
    "require_cluster",
    "served_by",
    "wait_until",
]


def require_cluster() -> None:
    """Skip the test where namespaces cannot be made; under ``CI=true`` that is a failure."""
    why = cluster_supported()
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"cannot build a multi-host cluster in CI: {why}")
        pytest.skip(f"multi-host cluster unavailable: {why}")


@contextlib.contextmanager
def cluster(*hosts: str, subnets: Mapping[str, int | Sequence[int]] | None = None,
            routed: bool = True) -> Iterator[Cluster]:
    """A cluster of ``hosts`` (``subnets``: host -> subnet index, or several for a multi-homed
    host; subnets joined by a router that forwards no multicast, unless not ``routed``), torn
    down (processes by pid, namespaces by name) on exit."""
    require_cluster()
    with Cluster(hosts, env={"PYTHONPATH": pythonpath()}, cwd=ROOT, subnets=subnets,
                 routed=routed) as built:
        yield built


def mocker_worker(host: Host, model_dir: Path, *extra: str,
                  env: Mapping[str, str] | None = None) -> ChildProcess:
    """``python -m dynamo_zmq.worker --engine mocker`` on ``host``, no discovery flags."""
    return host.python("-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path",
                       str(model_dir), "--speedup-ratio", "1000", *extra, env=env)


def frontend(host: Host, *extra: str) -> ChildProcess:
    """``python -m dynamo_zmq.frontend`` on ``host`` (port 8000, no discovery flags)."""
    return host.python("-m", "dynamo_zmq.frontend", *extra)


def served_by(raw: Any) -> int:
    """The instance id in a raw response's ``x-dynamo-worker`` header."""
    return int(raw.headers["x-dynamo-worker"].split("/")[0], 16)


def complete(client: Any, model: str, max_tokens: int = 2) -> int:
    """One completion through ``client``; returns the instance that served it (raises on
    failure)."""
    raw = client.completions.with_raw_response.create(
        model=model, prompt="hello", max_tokens=max_tokens
    )
    raw.parse()
    return served_by(raw)


def wait_until(predicate: Callable[[], bool], timeout: float, step: float = 0.05) -> bool:
    """True once ``predicate()`` holds (exceptions count as not yet), False after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except Exception:
            pass
        time.sleep(step)
    return False
