"""Shared fixtures: unique namespaces, real child processes (always stopped by pid)."""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# mDNS in tests never leaves loopback, whatever a test forgets to pass.
os.environ["DYN_MDNS_INTERFACES"] = "127.0.0.1"

from tests.support.cluster import Cluster, cluster
from tests.support.procs import Proc

#: Modules that start the most (vLLM engines): scheduled first, so that in parallel runs
#: (pytest-xdist) the long ones do not end up alone at the tail.
_FIRST = ("test_vllm", "test_chaos", "test_fleet", "test_slurm", "test_cluster", "test_soak")


def _utf8(text: str) -> str:
    """``text`` with lone surrogates (bytes decoded with ``surrogateescape``) escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Captured output must be valid UTF-8 for pytest-xdist to send a report to the main
    process (one that is not ends the whole worker: ``DumpError``); escape what is not."""
    outcome = yield
    report = outcome.get_result()
    report.sections = [(title, _utf8(text)) for title, text in report.sections]
    if isinstance(report.longrepr, str):
        report.longrepr = _utf8(report.longrepr)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Group the tests for pytest-xdist's ``--dist loadgroup``: a module's tests run on one
    worker (module-scoped fixtures, such as a vLLM worker, start once), the modules that share
    the session's vLLM stack (``tiny_vllm_stack``) on one worker together, and the heavy
    modules go first. Without xdist the groups are inert and only the order changes.

    The group is written into the node id as xdist's own ``xdist_group`` mark would (``id@group``,
    which its scheduler splits on), since xdist 3.8 writes it where pytest 9.2 no longer reads
    it: there each test was scheduled alone, and a module's fixtures started again on every
    worker that got one of its tests."""
    def module(item: pytest.Item) -> str:
        return item.nodeid.split("::")[0]

    shared = {module(item) for item in items
              if "tiny_vllm_stack" in getattr(item, "fixturenames", ())}
    grouping = bool(getattr(config.option, "loadgroup", False))  # xdist workers, loadgroup
    for item in items:
        group = "tiny_vllm_stack" if module(item) in shared else module(item)
        if grouping:
            _join_group(item, group)

    def heavy_first(item: pytest.Item) -> int:
        return 0 if module(item).rsplit("/", 1)[-1].startswith(_FIRST) else 1

    items.sort(key=heavy_first)  # stable: the order within each class is kept


def _join_group(item: pytest.Item, group: str) -> None:
    """Put ``item`` in xdist ``loadgroup`` group ``group`` (its node id gains ``@group``)."""
    nodeid = f"{item.nodeid}@{group}"
    if hasattr(item, "_id"):  # pytest >= 9.2: the node id is structured
        from _pytest.nodeid import coerce_node_id

        item._id = coerce_node_id(nodeid)
    else:
        item._nodeid = nodeid


@pytest.fixture
def namespace() -> str:
    """A namespace no other test (or parallel run) uses."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback TCP port something else is listening on, for the test's duration."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


@pytest.fixture
def spawn() -> Iterator[Callable[..., Proc]]:
    """Start ``python -m MODULE ARGS...`` children; all are stopped at teardown."""
    procs: list[Proc] = []

    def start(*args: str, env: dict[str, str] | None = None, ready: bool = True) -> Proc:
        proc = Proc(list(args), env=env)
        procs.append(proc)
        return proc.wait_ready() if ready else proc

    yield start
    for proc in procs:
        proc.stop()


@pytest.fixture
def make_cluster() -> Iterator[Callable[..., Cluster]]:
    """Build multi-host clusters: ``make_cluster("a", "b")`` (see tests/support/cluster.py);
    each is torn down at teardown, processes by pid, namespaces by name. A module that shares
    one cluster across its tests uses ``with cluster(...)`` in a module-scoped fixture."""
    with contextlib.ExitStack() as stack:
        yield lambda *hosts: stack.enter_context(cluster(*hosts))


@contextlib.asynccontextmanager
async def runtime_factory() -> AsyncIterator[Callable[..., Any]]:
    """Build in-process runtimes pinned to loopback; all are closed on exit (in the event loop
    that made them: a test on a module-scoped loop needs its own fixture over this)."""
    from dynamo_zmq.discovery import DiscoveryConfig
    from dynamo_zmq.runtime import DistributedRuntime, RuntimeConfig

    runtimes: list[DistributedRuntime] = []

    def make(static: tuple[str, ...] | None = None, port: int = 0) -> DistributedRuntime:
        if static is None:
            disc = DiscoveryConfig(backend="mdns", mdns_interfaces=("127.0.0.1",))
        else:
            disc = DiscoveryConfig(backend="static", static_addresses=static)
        rt = DistributedRuntime(config=RuntimeConfig(discovery=disc, host="127.0.0.1", port=port))
        runtimes.append(rt)
        return rt

    try:
        yield make
    finally:
        for rt in runtimes:
            await rt.close()


@pytest.fixture
async def make_runtime() -> AsyncIterator[Callable[..., Any]]:
    """``runtime_factory`` for tests on the default (function-scoped) event loop."""
    async with runtime_factory() as make:
        yield make


def app_args(namespace: str, *extra: str) -> list[str]:
    """Arguments for ``tests.support.app`` on loopback."""
    return ["-m", "tests.support.app", "--namespace", namespace, "--host", "127.0.0.1", *extra]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama model directory, built once per session.

    ``DYN_TINY_MODEL_DIR`` names a directory to build into and reuse across sessions.
    """
    from dynamo_zmq.tools.tiny_model import build_tiny_model

    cached = os.environ.get("DYN_TINY_MODEL_DIR")
    out = Path(cached) if cached else tmp_path_factory.mktemp("tiny_model") / "model"
    return build_tiny_model(out)


@pytest.fixture(scope="session")
def tiny_vllm_stack(tiny_model: Path) -> Iterator[Any]:
    """One vLLM worker serving the tiny model as ``tiny`` (default flags) and a frontend,
    shared by the vLLM modules that only send requests through them (a vLLM start costs
    20-60 s on a CI box); started by the first test that asks, stopped at the session's end."""
    from tests.support.vllm_stack import vllm_stack

    with vllm_stack(tiny_model) as stack:
        yield stack
