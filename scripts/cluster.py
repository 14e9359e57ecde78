"""A multi-host cluster on this machine, for manual runs (root and iproute2 needed).

    sudo python scripts/cluster.py [--hosts a,b,c,d] [--frontends a,d] [--workers b=2,c=1]
        [--model-path DIR] [--worker-args "..."] [--frontend-args "..."]

Builds one network namespace per host on a private bridge (``dynamo_zmq.tools.netns``), starts
a frontend (port 8000) on each ``--frontends`` host and the given number of mocker workers on
each ``--workers`` host, all with no discovery flag, and prints how to reach each frontend.
Then it reads commands on stdin, one a line, until ``quit``, Ctrl-C or SIGTERM:

    cut HOST | heal HOST      take HOST's link down / up
    silent-cut HOST           drop HOST's frames, link kept up (undo with heal)
    freeze HOST | thaw HOST   SIGSTOP / SIGCONT every process on HOST
    hosts                     list hosts, addresses and processes
    quit

With stdin closed (run in the background) it runs until Ctrl-C or SIGTERM. On exit it stops
every process it started and deletes its namespaces. Without ``--model-path`` a tiny random
model is built in a temporary directory.
"""

from __future__ import annotations

import argparse
import functools
import shlex
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from dynamo_zmq.tools.child_process import ChildProcess
from dynamo_zmq.tools.netns import Cluster, Host, cluster_supported
from dynamo_zmq.tools.tiny_model import build_tiny_model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", default="a,b,c,d", help="host names (default %(default)s)")
    parser.add_argument("--frontends", default="a,d", help="hosts with a frontend")
    parser.add_argument("--workers", default="b=1,c=1",
                        help="HOST=COUNT of mocker workers, comma-separated (default %(default)s)")
    parser.add_argument("--model-path", help="model directory (default: a tiny random model)")
    parser.add_argument("--worker-args", default="--speedup-ratio 10",
                        help="extra worker flags (default %(default)r)")
    parser.add_argument("--frontend-args", default="", help="extra frontend flags")
    return parser.parse_args()


def describe(cluster: Cluster, procs: dict[str, list[tuple[str, ChildProcess]]]) -> None:
    for host in cluster.hosts.values():
        running = ", ".join(f"{kind} pid {p.pid}" for kind, p in procs[host.name])
        print(f"  {host.name}: {host.address} netns {host.netns}: {running or 'nothing'}")


def main() -> int:
    args = parse_args()
    why = cluster_supported()
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    hosts = [h for h in args.hosts.split(",") if h]
    workers = {h: int(n) for h, _, n in (w.partition("=") for w in args.workers.split(",") if w)}
    fronts = [h for h in args.frontends.split(",") if h]
    unknown = (set(workers) | set(fronts)) - set(hosts)
    if unknown:
        print(f"error: not in --hosts: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    with tempfile.TemporaryDirectory(prefix="dz-cluster-") as tmp, Cluster(hosts) as cluster:
        model = args.model_path or str(build_tiny_model(Path(tmp) / "model"))
        procs: dict[str, list[tuple[str, ChildProcess]]] = {h: [] for h in hosts}
        try:
            for name, count in workers.items():
                for _ in range(count):
                    proc = cluster[name].python(
                        "-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path", model,
                        *shlex.split(args.worker_args), timeout=120,
                    )
                    procs[name].append((f"worker {proc.instance_id:x}", proc))
            for name in fronts:
                proc = cluster[name].python(
                    "-m", "dynamo_zmq.frontend", *shlex.split(args.frontend_args), timeout=120
                )
                procs[name].append(("frontend", proc))
            print(f"cluster {cluster.id} on {cluster.subnet}:")
            describe(cluster, procs)
            for name in fronts:
                host = cluster[name]
                print(f"frontend on {name}:  curl --unix-socket {host.uds(8000)} "
                      f"http://{name}/v1/models")
                print(f"    or:  sudo ip netns exec {host.netns} curl "
                      "http://127.0.0.1:8000/v1/models")
            print("commands: cut|silent-cut|heal|freeze|thaw HOST, hosts, quit (or Ctrl-C)",
                  flush=True)
            commands(cluster, procs)
        except KeyboardInterrupt:
            pass
        print("stopping: processes by pid, then the namespaces", flush=True)
    return 0


def commands(cluster: Cluster, procs: dict[str, list[tuple[str, ChildProcess]]]) -> None:
    """Run commands from stdin; at end of input, wait for Ctrl-C or SIGTERM."""
    actions: dict[str, Callable[[Host], None]] = {
        "cut": cluster.cut, "heal": cluster.heal, "freeze": cluster.freeze, "thaw": cluster.thaw,
        "silent-cut": functools.partial(cluster.cut, silent=True),
    }
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "quit":
            return
        if words[0] == "hosts":
            describe(cluster, procs)
        elif words[0] in actions and len(words) == 2 and words[1] in cluster.hosts:
            actions[words[0]](cluster[words[1]])
            print(f"{words[0]} {words[1]}: done", flush=True)
        else:
            print(f"unknown command {line.strip()!r}; hosts: {', '.join(cluster.hosts)}",
                  flush=True)
    signal.pause()  # stdin closed: until Ctrl-C or SIGTERM


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
