"""Mocker fleets for tests: mocker workers and a frontend over them, real processes started
through the ``spawn`` fixture (so stopped at teardown, by pid).

``mocker_fleet(spawn, namespace, model_dir, n)`` starts ``n`` identical mocker workers and a
frontend (``--router-mode kv`` unless told otherwise) and returns once the frontend's
``/health`` lists exactly those workers. Tests whose workers differ, or whose frontends come
later, build the same processes one at a time with ``start_mocker`` and ``start_frontend``
and wait with ``serving`` (tests/support/waiting.py); ``start_worker`` starts a worker on any
engine (``ECHO``: the echo test engine).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.support.procs import Proc
from tests.support.waiting import serving

__all__ = ["ECHO", "Fleet", "mocker_fleet", "serving", "start_frontend", "start_mocker",
           "start_worker"]

#: The ``spawn`` fixture (tests/conftest.py).
Spawn = Callable[..., Proc]

#: The echo test engine (tests/support/engines.py), for ``start_worker``'s ``engine``.
ECHO = "tests.support.engines:EchoEngine"


@dataclass(frozen=True)
class Fleet:
    """A frontend and the mocker workers it lists."""

    front: Proc
    workers: list[Proc]

    @property
    def url(self) -> str:
        """The frontend's ``http://HOST:PORT``."""
        return self.front.address

    @property
    def ids(self) -> set[str]:
        """The workers' instance ids in hex, as ``/health`` and ``x-dynamo-worker`` show them."""
        return {f"{w.instance_id:x}" for w in self.workers}


def start_worker(spawn: Spawn, namespace: str, model_dir: Path | str, *extra: str,
                 engine: str = "mocker", model: str = "tiny", speedup: str | None = "1000",
                 env: Mapping[str, str] | None = None, ready: bool = False) -> Proc:
    """Start ``python -m dynamo_zmq.worker --engine ENGINE`` serving ``model`` from
    ``model_dir`` on loopback; it waits for the worker's READY only with ``ready``.

    Args:
        spawn: the ``spawn`` fixture.
        namespace: the namespace it registers in.
        model_dir: the model directory (``--model-path``).
        *extra: more worker flags.
        engine: ``--engine`` (a name or ``module:Class``).
        model: the served model name (``--model-name``).
        speedup: ``--speedup-ratio``, passed only when ``engine`` is ``mocker`` (None: the
            mocker's default).
        env: extra environment variables.
        ready: wait until it says READY.
    """
    speed = () if engine != "mocker" or speedup is None else ("--speedup-ratio", speedup)
    return spawn("-m", "dynamo_zmq.worker", "--engine", engine, "--model-path", str(model_dir),
                 "--model-name", model, "--namespace", namespace, "--host", "127.0.0.1",
                 *speed, *extra, env=dict(env) if env else None, ready=ready)


def start_mocker(spawn: Spawn, namespace: str, model_dir: Path | str, *extra: str,
                 model: str = "tiny", speedup: str | None = "1000",
                 env: Mapping[str, str] | None = None) -> Proc:
    """``start_worker`` with the mocker engine, without waiting for it (``serving`` or
    ``wait_ready`` does)."""
    return start_worker(spawn, namespace, model_dir, *extra, model=model, speedup=speedup,
                        env=env)


def start_frontend(spawn: Spawn, namespace: str, *extra: str, mode: str | None = "kv",
                   env: Mapping[str, str] | None = None, ready: bool = False) -> Proc:
    """Start ``python -m dynamo_zmq.frontend`` on a free port in ``namespace``; it waits for
    the frontend's READY only with ``ready``.

    Args:
        spawn: the ``spawn`` fixture.
        namespace: the namespace it discovers workers in.
        *extra: more frontend flags.
        mode: ``--router-mode`` (None: the frontend's default).
        env: extra environment variables.
        ready: wait until it says READY.
    """
    router = () if mode is None else ("--router-mode", mode)
    return spawn("-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace", namespace,
                 *router, *extra, env=dict(env) if env else None, ready=ready)


async def mocker_fleet(spawn: Spawn, namespace: str, model_dir: Path | str, n: int = 2, *,
                       mode: str | None = "kv", worker_args: Sequence[str] = (),
                       frontend_args: Sequence[str] = (), speedup: str | None = "1000",
                       model: str = "tiny", env: Mapping[str, str] | None = None,
                       timeout: float = 30.0) -> Fleet:
    """Start ``n`` mocker workers (``start_mocker`` with ``worker_args``) and a frontend
    (``start_frontend`` with ``frontend_args``), all with ``env``, and wait until the frontend
    lists all ``n`` for ``model``.

    Raises:
        AssertionError: the frontend did not list them all within ``timeout`` seconds.
        RuntimeError: a process exited before it was ready.
        TimeoutError: a process did not say READY in time.
    """
    workers = [start_mocker(spawn, namespace, model_dir, *worker_args, model=model,
                            speedup=speedup, env=env) for _ in range(n)]
    front = start_frontend(spawn, namespace, *frontend_args, mode=mode, env=env)
    await serving(front, workers, model, timeout)
    return Fleet(front, workers)
