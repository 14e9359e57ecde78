"""A real Slurm on the multi-host harness: munged, slurmctld and one slurmd per namespace host.

``slurm(cluster)`` is a context manager: it writes a munge key and a slurm.conf into a fresh
temporary directory, starts one ``munged`` for the machine (a Unix socket in that directory,
which every namespace sees), ``slurmctld`` on the cluster's first host and a ``slurmd`` on
every host, each in a UTS namespace of its own whose hostname is the node's name, and waits
until every node is idle. Slurm's commands run inside the first host (``Slurm.run``) with
``SLURM_CONF`` pointing at that configuration; the cluster's environment gets it too, so
everything started in the cluster (jobs included) uses this Slurm. Leaving it stops the daemons
by pid (slurmd, then slurmctld, then munged) and removes the directory.

No cgroups: ``ip netns exec`` mounts a fresh /sys without /sys/fs/cgroup, so processes are
tracked by process tree (proctrack/linuxproc), tasks are not bound (task/none), and cgroup.conf
names cgroup/v1 only so that slurmd's cgroup plugin loads without probing /sys/fs/cgroup.

``require_slurm(__file__)`` at a test module's top skips the module where Slurm's or munge's
programs are missing, except under ``CI=true``, where that is a failure.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamo_zmq.tools.child_process import ChildProcess
from dynamo_zmq.tools.netns import Cluster

__all__ = ["PROGRAMS", "Slurm", "require_slurm", "slurm", "slurm_missing"]

#: What the Slurm tests run (Debian: slurmctld, slurmd, slurm-client, munge).
PROGRAMS = ("slurmctld", "slurmd", "sbatch", "srun", "scancel", "squeue", "scontrol", "sinfo",
            "munged", "unshare")
#: CPUs each node claims (more than this machine has: SlurmdParameters=config_overrides).
NODE_CPUS = 8


def slurm_missing() -> str | None:
    """``None`` if Slurm and munge are installed, else what is missing."""
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        return (f"{', '.join(missing)} not found on PATH (Debian: apt-get install slurmctld "
                "slurmd slurm-client munge)")
    return None


def require_slurm(module: str | None = None) -> None:
    """Skip the test where Slurm cannot run; under ``CI=true`` that is a failure. ``module``
    (a test module's ``__file__``, called at its import) skips the whole module, saying so on
    stderr."""
    why = slurm_missing()
    if why is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"cannot run a real Slurm in CI: {why}", pytrace=False)
    if module is not None:
        print(f"SKIP {os.path.relpath(module)}: Slurm unavailable: {why}", file=sys.stderr)
    pytest.skip(f"Slurm unavailable: {why}", allow_module_level=module is not None)


def _conf(cluster: Cluster, base: Path, kill_wait: int) -> str:
    first = next(iter(cluster.hosts.values()))
    nodes = "\n".join(
        f"NodeName={h.name} NodeAddr={h.address} CPUs={NODE_CPUS} RealMemory=1000 State=UNKNOWN"
        for h in cluster.hosts.values()
    )
    return f"""\
ClusterName=dzt{cluster.id}
SlurmctldHost={first.name}({first.address})
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={base}/munge/munge.sock
SlurmUser=root
SlurmdUser=root
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool/%n
SlurmctldPidFile={base}/slurmctld.pid
SlurmdPidFile={base}/slurmd-%n.pid
SlurmctldLogFile={base}/slurmctld.log
SlurmdLogFile={base}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
KillWait={kill_wait}
MinJobAge=300
InactiveLimit=0
{nodes}
PartitionName=all Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class Slurm:
    """A running Slurm on ``cluster``'s hosts (see the module's docstring)."""

    def __init__(self, cluster: Cluster, kill_wait: int = 20) -> None:
        self.cluster = cluster
        self.kill_wait = kill_wait
        self.first = next(iter(cluster.hosts.values()))
        self.dir = Path(tempfile.mkdtemp(prefix=f"dz{cluster.id}-slurm-"))
        self.conf = self.dir / "slurm.conf"
        self.munged: subprocess.Popen[bytes] | None = None
        self.daemons: list[ChildProcess] = []

    def start(self, timeout: float = 30.0) -> None:
        """Start munged, slurmctld and every slurmd; wait until every node is idle."""
        base = self.dir
        base.chmod(0o755)  # munged wants its socket's directory searchable by all
        for sub in ("munge", "state", *(f"spool/{h}" for h in self.cluster.hosts)):
            (base / sub).mkdir(parents=True)
        (base / "munge").chmod(0o755)
        key = base / "munge" / "munge.key"
        key.touch(mode=0o600)
        key.write_bytes(os.urandom(1024))  # what mungekey --create writes
        with open(base / "munged.log", "wb") as log:
            self.munged = subprocess.Popen(
                ["munged", "--foreground", "--force", f"--socket={base}/munge/munge.sock",
                 f"--key-file={key}", f"--pid-file={base}/munge/munged.pid",
                 f"--seed-file={base}/munge/munged.seed"],
                stdout=log, stderr=subprocess.STDOUT,
            )
        self.conf.write_text(_conf(self.cluster, base, self.kill_wait))
        # ip netns exec gives its processes a /sys without cgroups: never probe them.
        (base / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        self.cluster.env["SLURM_CONF"] = str(self.conf)
        self._wait_for_munge(timeout)
        conf = str(self.conf)
        self.daemons.append(self._daemon(self.first.name, ["slurmctld", "-D", "-f", conf]))
        for name in self.cluster.hosts:
            self.daemons.append(
                self._daemon(name, ["slurmd", "-D", "-N", name, "-f", conf])
            )
        self._wait_idle(timeout)

    def _daemon(self, host: str, argv: list[str]) -> ChildProcess:
        """``argv`` on ``host`` in a UTS namespace of its own, whose hostname is ``host``."""
        script = (f'{{ hostname {host} || echo {host} > /proc/sys/kernel/hostname; }} 2>/dev/null'
                  ' && exec "$@"')
        return self.cluster[host].spawn(["unshare", "--uts", "sh", "-c", script, "sh", *argv],
                                        ready=False)

    def _wait_for_munge(self, timeout: float) -> None:
        sock = self.dir / "munge" / "munge.sock"
        deadline = time.monotonic() + timeout
        while not sock.exists():
            assert self.munged is not None
            if self.munged.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start:\n{self.log('munged.log')}")
            time.sleep(0.05)

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        want = len(self.cluster.hosts)
        out = ""
        while time.monotonic() < deadline:
            for proc in self.daemons:
                if not proc.running():
                    raise RuntimeError(f"{proc.argv[-4:]} exited:\n{proc.logs()}\n"
                                       f"{self.log('slurmctld.log')}")
            out = self.run("sinfo", "--noheader", "--format=%n %t").stdout
            if sum(line.split()[-1] == "idle" for line in out.splitlines()) == want:
                return
            time.sleep(0.2)
        raise TimeoutError(f"Slurm nodes not idle in {timeout}s: {out!r}\n"
                           f"{self.log('slurmctld.log')}")

    def run(self, *argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """A Slurm command inside the first host (where slurmctld listens)."""
        return self.first.run(list(argv), timeout=timeout)

    def sbatch(self, script: Path, *args: str, options: tuple[str, ...] = ()) -> int:
        """Submit ``script ARGS``; returns the job id."""
        done = self.run("sbatch", "--parsable", *options, str(script), *args)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch failed: {done.stderr}")
        return int(done.stdout.strip().split(";")[0])

    def state(self, job: int) -> str:
        """The job's state (``PENDING``, ``RUNNING``, ``CANCELLED``, ...), ``""`` once it is
        gone from slurmctld."""
        done = self.run("scontrol", "show", "job", "--oneliner", str(job))
        match = re.search(r"\bJobState=(\S+)", done.stdout)
        return match.group(1) if match else ""

    def ended(self, job: int) -> bool:
        """True once the job is over and every node has released it (no step left)."""
        done = self.run("squeue", "--noheader", "--jobs", str(job), "--format=%T")
        if done.returncode != 0:  # purged after MinJobAge: over long ago; else slurmctld failed
            return "Invalid job id" in done.stderr
        return done.stdout.strip() == ""

    def log(self, name: str) -> str:
        """The end of one of Slurm's logs (``slurmctld.log``, ``slurmd-n1.log``, ...)."""
        path = self.dir / name
        return path.read_text(errors="replace")[-4000:] if path.exists() else f"({name}: none)"

    def close(self) -> None:
        """Stop slurmd, slurmctld and munged by pid; remove the directory. Idempotent."""
        for proc in reversed(self.daemons):  # slurmds first, slurmctld last
            proc.stop(timeout=10.0)
        self.daemons.clear()
        if self.munged is not None:
            if self.munged.poll() is None:
                self.munged.send_signal(signal.SIGTERM)
                try:
                    self.munged.wait(10)
                except subprocess.TimeoutExpired:
                    self.munged.kill()
                    self.munged.wait(10)
            self.munged = None
        self.cluster.env.pop("SLURM_CONF", None)
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def slurm(cluster: Cluster, kill_wait: int = 20, timeout: float = 30.0) -> Iterator[Slurm]:
    """A Slurm on every host of ``cluster`` (its first host the controller), stopped on exit."""
    require_slurm()
    built = Slurm(cluster, kill_wait=kill_wait)
    try:
        built.start(timeout)
        yield built
    finally:
        built.close()
