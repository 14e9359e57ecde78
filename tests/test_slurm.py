"""``scripts/slurm/dynamo.sbatch`` under a real Slurm, on hosts that are network namespaces.

Three hosts (``tests/support/cluster.py``), each with its own slurmd, slurmctld on the first,
one munged for the machine (``tests/support/slurm.py``). The script is submitted with
``sbatch --nodes=3`` and ``--gpus-per-node 2`` (there are no GPUs: the mocker engine needs
none): one frontend on n1 and six workers, two a node, found by mDNS or through a directory.
Each test waits for the job's ``DYNAMO_FRONTEND_URL=`` line, checks that the frontend serves
and lists the six workers, then stops the job the way an operator would and checks that every
worker drained (its log lines, an in-flight request that still completes), that the job left
no process on any host and, with directory discovery, no advert file.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.cluster import Cluster, cluster, served_by, wait_until
from tests.support.procs import ROOT
from tests.support.slurm import Slurm, require_slurm, slurm

require_slurm(__file__)

SCRIPT = ROOT / "scripts" / "slurm" / "dynamo.sbatch"
NODES = ("n1", "n2", "n3")
GPUS_PER_NODE = 2
WORKERS = len(NODES) * GPUS_PER_NODE
PORT = 8000
#: Slurm's SIGTERM-to-SIGKILL delay, above the workers' graceful timeout.
KILL_WAIT = 20
GRACEFUL_TIMEOUT = 10
#: The mocker at a tenth of its speed: ~67 ms a token, so a 40-token stream is still running
#: when the job is stopped, and ends within the frontend's 5 s for open streams.
SPEEDUP = "0.1"
STREAM_TOKENS = 40
#: Bounds (seconds) on a 2-core machine: the URL line after sbatch, the job's end after a stop.
URL_WITHIN = 60.0
END_WITHIN = KILL_WAIT + 15.0


@dataclass
class Job:
    """One submitted ``dynamo.sbatch`` job on a Slurm of namespace hosts."""

    cluster: Cluster
    slurm: Slurm
    id: int
    output: Path
    #: Every process in each host before the job (the Slurm daemons).
    before: dict[str, set[int]] = field(default_factory=dict)
    discovery_dir: Path | None = None
    #: The discovery directory did not exist before the job (the job makes and removes it).
    dir_made_by_job: bool = False

    def text(self) -> str:
        return self.output.read_text(errors="replace") if self.output.exists() else ""

    def context(self) -> str:
        """The job's output and slurmctld's log, for a failed assertion."""
        return (f"\n--- job {self.id} ({self.slurm.state(self.id)}) output:\n{self.text()[-8000:]}"
                f"\n--- slurmctld.log:\n{self.slurm.log('slurmctld.log')[-2000:]}")

    def url(self) -> str:
        """The ``DYNAMO_FRONTEND_URL=`` line's URL, once the job printed it."""
        found: list[str] = []

        def printed() -> bool:
            found[:] = re.findall(r"^DYNAMO_FRONTEND_URL=(\S+)$", self.text(), re.MULTILINE)
            return bool(found) or self.slurm.ended(self.id)

        assert wait_until(printed, URL_WITHIN, step=0.2) and found, (
            f"no DYNAMO_FRONTEND_URL line within {URL_WITHIN}s{self.context()}"
        )
        return found[0]

    def ready_instances(self) -> set[int]:
        """The instance ids of the workers' ``N: READY tcp://... IID`` lines."""
        return {int(iid, 16) for iid in
                re.findall(r"^\d+: READY \S+ ([0-9a-f]+)$", self.text(), re.MULTILINE)}

    def tasks_that_logged(self, message: str) -> set[int]:
        """The worker tasks (``--label`` numbers) whose output has ``message``."""
        return {int(task) for task in
                re.findall(rf"^(\d+): .*{re.escape(message)}", self.text(), re.MULTILINE)}

    def stray_processes(self) -> dict[str, list[str]]:
        """Processes in the hosts that are neither Slurm's daemons nor the harness's own."""
        harness = {proc.pid for proc in self.cluster.procs}
        stray: dict[str, list[str]] = {}
        for host in self.cluster.hosts.values():
            for pid in set(host.pids()) - self.before[host.name] - harness:
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                except OSError:
                    continue  # gone meanwhile
                stray.setdefault(host.name, []).append(f"{pid} {cmd.decode(errors='replace')}")
        return stray


@pytest.fixture
def submit(tiny_model: Path, tmp_path: Path) -> Iterator[Callable[..., Job]]:
    """``submit(discovery)``: a 3-host Slurm and ``dynamo.sbatch`` submitted to it (a ``Job``);
    everything is torn down at teardown: the job, the daemons by pid, the namespaces."""
    with cluster(*NODES) as hosts, slurm(hosts, kill_wait=KILL_WAIT) as built:
        jobs: list[Job] = []

        def start(discovery: str, make_dir: bool = False) -> Job:
            args = ["--engine", "mocker", "--model-path", str(tiny_model),
                    "--gpus-per-node", str(GPUS_PER_NODE), "--port", str(PORT),
                    "--python", sys.executable, "--discovery", discovery,
                    "--graceful-timeout", str(GRACEFUL_TIMEOUT)]
            directory = None
            if discovery == "dir":
                directory = tmp_path / "discovery"
                if not make_dir:
                    directory.mkdir()
                args += ["--discovery-dir", str(directory)]
            before = {h.name: set(h.pids()) for h in hosts.hosts.values()}
            output = tmp_path / "job.out"
            job_id = built.sbatch(
                SCRIPT, *args, "--", "--speedup-ratio", SPEEDUP,
                options=(f"--nodes={len(NODES)}", f"--output={output}", "--time=10"),
            )
            job = Job(hosts, built, job_id, output, before, directory, make_dir)
            jobs.append(job)
            return job

        try:
            yield start
        finally:
            for job in jobs:
                built.run("scancel", str(job.id))
                wait_until(functools.partial(built.ended, job.id), END_WITHIN, step=0.5)


def check_serving(job: Job) -> set[int]:
    """The URL names n1; the frontend lists the six workers of the READY lines and serves a
    completion with one of them; each node's two workers see GPU 0 and GPU 1. Returns the
    workers' instance ids."""
    first = job.cluster["n1"]
    assert job.url() == f"http://{first.address}:{PORT}", job.context()
    http = first.http(PORT)
    listed: set[int] = set()

    def six_listed() -> bool:
        models = http.get("/health").json()["models"]
        listed.clear()
        listed.update(int(iid, 16) for ids in models.values() for iid in ids)
        return len(listed) == WORKERS

    assert wait_until(six_listed, 30, step=0.2), f"/health lists {listed}{job.context()}"
    # A worker is discoverable just before its READY line reaches the job's output file.
    assert wait_until(lambda: listed == job.ready_instances(), 30, step=0.2), job.context()
    client = first.openai_client(PORT)
    model = client.models.list().data[0].id
    raw = client.completions.with_raw_response.create(model=model, prompt="hi", max_tokens=2)
    raw.parse()
    assert served_by(raw) in listed
    for host in job.cluster.hosts.values():
        assert gpus_seen(host.pids()) == ["0", "1"], f"{host.name}{job.context()}"
    if job.discovery_dir is not None:
        adverts = list(job.discovery_dir.glob("*.json"))
        assert len(adverts) == WORKERS, (adverts, job.context())
    return listed


def gpus_seen(pids: list[int]) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` of the worker processes among ``pids``, sorted."""
    seen = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"dynamo_zmq.worker" in cmd:
            found = [v for v in env if v.startswith(b"CUDA_VISIBLE_DEVICES=")]
            seen.append(found[0].split(b"=", 1)[1].decode() if found else "(unset)")
    return sorted(seen)


class Stream(threading.Thread):
    """A streaming completion through the frontend on n1, read to its end in a thread."""

    def __init__(self, job: Job, model: str) -> None:
        super().__init__(daemon=True)
        self.client = job.cluster["n1"].openai_client(PORT, timeout=60.0)
        self.model = model
        self.first_chunk = threading.Event()
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for chunk in self.client.completions.create(
                model=self.model, prompt="hello", max_tokens=STREAM_TOKENS, stream=True,
                stream_options={"include_usage": True},
            ):
                self.first_chunk.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    self.finish_reason = chunk.choices[0].finish_reason
                if chunk.usage is not None:
                    self.completion_tokens = chunk.usage.completion_tokens
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.first_chunk.set()


def stop_with_a_request_in_flight(job: Job, *command: str) -> Stream:
    """Start a 40-token stream, run ``command`` (a Slurm command) once its first chunk came,
    and wait for the job to end; returns the stream (ended)."""
    model = job.cluster["n1"].openai_client(PORT).models.list().data[0].id
    stream = Stream(job, model)
    stream.start()
    assert stream.first_chunk.wait(30), job.context()
    assert stream.error is None, f"{stream.error!r}{job.context()}"
    done = job.slurm.run(*command)
    assert done.returncode == 0, done.stderr
    assert wait_until(lambda: job.slurm.ended(job.id), END_WITHIN, step=0.2), (
        f"the job did not end within {END_WITHIN}s{job.context()}"
    )
    stream.join(30)
    return stream


def check_drained(job: Job, stream: Stream) -> None:
    """Every worker unregistered and stopped without being forced, the in-flight stream got
    all its tokens, no process is left on any host, no advert file in the directory."""
    everyone = set(range(WORKERS))
    text = job.text()
    assert job.tasks_that_logged("shutting down: unregistering") == everyone, job.context()
    assert job.tasks_that_logged("worker stopped") == everyone, job.context()
    assert job.tasks_that_logged("engine drain with 1 in flight"), job.context()
    for bad in ("second signal", "s) over with", "handed over", "Killed", "scancel: error"):
        assert bad not in text, f"{bad!r}{job.context()}"
    assert stream.error is None, f"{stream.error!r}{job.context()}"
    assert stream.finish_reason == "length", job.context()
    assert stream.completion_tokens == STREAM_TOKENS, job.context()
    assert wait_until(lambda: not job.stray_processes(), 10, step=0.2), (
        f"left behind: {job.stray_processes()}{job.context()}"
    )
    if job.discovery_dir is not None and job.dir_made_by_job:
        assert not job.discovery_dir.exists(), job.context()
    elif job.discovery_dir is not None:
        assert list(job.discovery_dir.iterdir()) == [], job.context()


@pytest.mark.parametrize("discovery", ["mdns", "dir"])
def test_scancel_drains_a_three_node_deployment(submit: Callable[..., Job], discovery: str) -> None:
    job = submit(discovery)
    check_serving(job)
    stream = stop_with_a_request_in_flight(job, "scancel", str(job.id))
    assert job.slurm.state(job.id) == "CANCELLED", job.context()
    check_drained(job, stream)
    assert "dynamo: SIGTERM: Slurm is stopping the steps" in job.text(), job.context()


def test_usr1_drains_the_workers_before_the_frontend(submit: Callable[..., Job]) -> None:
    """``scancel -b -s USR1`` (what ``#SBATCH --signal`` sends before the time limit): the
    workers stop first, then the frontend, and the job completes with exit 0; the discovery
    directory, made by the job, is removed."""
    job = submit("dir", make_dir=True)
    check_serving(job)
    stream = stop_with_a_request_in_flight(job, "scancel", "--batch", "--signal=USR1",
                                           str(job.id))
    done = job.slurm.run("scontrol", "show", "job", "--oneliner", str(job.id))
    assert "JobState=COMPLETED" in done.stdout and "ExitCode=0:0" in done.stdout, (
        done.stdout + job.context()
    )
    check_drained(job, stream)
    text = job.text()
    workers_done = max(m.end() for m in re.finditer(r"^\d+: .*worker stopped$", text, re.M))
    assert workers_done < text.index("dynamo: workers stopped; stopping the frontend"), (
        job.context()
    )


def test_the_script_passes_bash_n_and_shellcheck() -> None:
    """``bash -n`` and ``shellcheck`` (the shellcheck package) find nothing in the script."""
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    if shutil.which("shellcheck") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("shellcheck is not installed (the shellcheck package)")
        pytest.skip("shellcheck is not installed (the shellcheck package)")
    done = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
