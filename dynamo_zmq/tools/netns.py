"""A cluster of hosts on one machine: Linux network namespaces joined by a bridge.

Each host is a network namespace with ``lo`` and one veth (``eth0``) holding its own IPv4
address on a private /24 (a random one of 198.18.0.0/15, the range set aside for network
testing). The other end of every veth is a port of a bridge that lives in a namespace of its
own; both ends are created directly inside their namespaces, so nothing touches the machine's
own interfaces. The bridge floods multicast (snooping off), so mDNS works as on one LAN.

With ``subnets`` the hosts sit on several /24s, each its own bridge, joined by a router (a
namespace of its own, the ``.254`` of every subnet, every host's default gateway) that
forwards unicast and, like a plain IP router, no multicast: mDNS stays within a subnet. A host
given several subnets is multi-homed (``eth0``, ``eth1``... one on each); with
``routed=False`` no router joins the subnets: each host reaches only the subnets it is on.

Processes are started inside a host with ``ip netns exec`` and stopped by pid. ``cut``/``heal``
take a host's bridge port down and up (the host's link loses carrier, as when a cable is
pulled), or with ``silent=True`` disable it (frames dropped, carrier kept); ``freeze``/``thaw``
send SIGSTOP/SIGCONT to every process in the host's namespace.
Children start with no ``DYN_*`` variable of this process: zero configuration, unless asked.

``Cluster`` is a context manager: leaving it (also on an error during setup) stops the
processes it started, kills any process still left inside its namespaces (their children),
and deletes exactly the namespaces it made, by name. Needs root and iproute2 (``ip``,
``bridge``).

    with Cluster(["a", "b"]) as cluster:
        worker = cluster["b"].python("-m", "dynamo_zmq.worker", "--engine", "mocker", ...)
        front = cluster["a"].python("-m", "dynamo_zmq.frontend")
        client = cluster["a"].openai_client(8000)
        cluster.cut(cluster["b"]); cluster.heal(cluster["b"])
"""

from __future__ import annotations

import contextlib
import importlib
import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from .child_process import ChildProcess

if TYPE_CHECKING:
    import openai

__all__ = ["Cluster", "ClusterError", "Host", "cluster_supported"]

#: The veth inside every host.
HOST_IFACE = "eth0"
_HOST_NAME = re.compile(r"^[a-z][a-z0-9]{0,7}$")


def _bridge_name(subnet: int) -> str:
    return f"br{subnet}"


class ClusterError(RuntimeError):
    """An ``ip`` or ``bridge`` command failed while building or changing the cluster."""


def cluster_supported() -> str | None:
    """``None`` if this process can build a cluster, else why not."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if shutil.which("ip") is None or shutil.which("bridge") is None:
        return "the ip and bridge commands (iproute2) are not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    return None


def ip(*args: str, check: bool = True) -> str:
    """Run ``ip ARGS...``; returns stdout. Raises ClusterError when it fails and ``check``."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise ClusterError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def _indexes(subnet: int | Sequence[int]) -> list[int]:
    return [subnet] if isinstance(subnet, int) else list(subnet)


def _bridge(*args: str) -> None:
    done = subprocess.run(["bridge", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise ClusterError(f"bridge {' '.join(args)}: {done.stderr.strip()}")


class Host:
    """One host of a ``Cluster``: a network namespace with one address.

    Attributes:
        name: the short name given to the cluster (``"a"``).
        netns: the network namespace's name (unique per cluster).
        address: its IPv4 address on the cluster's network (its first, if multi-homed).
        port: its bridge port (in the bridge's namespace; its first).
        addresses, ports, on: each of its links' address, bridge port and subnet index.
    """

    def __init__(
        self, cluster: Cluster, name: str, netns: str, address: str, port: str, subnet: int = 0
    ) -> None:
        self.cluster = cluster
        self.name = name
        self.netns = netns
        self.address = address
        self.port = port
        #: The index of its (first) subnet (``Cluster.subnets``).
        self.subnet = subnet
        self.addresses, self.ports, self.on = [address], [port], [subnet]
        self._forwards: dict[int, ChildProcess] = {}

    def __repr__(self) -> str:
        return f"Host({self.name}, {self.address}, netns={self.netns})"

    def spawn(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        ready: bool = True,
        timeout: float = 30.0,
    ) -> ChildProcess:
        """Start ``argv`` inside this host; the cluster stops it on exit.

        Args:
            argv: the command line.
            env: variables added to the cluster's environment (which has no ``DYN_*``).
            ready: wait for its ``READY`` line (``ChildProcess.wait_ready``).
            timeout: seconds to wait for ``READY``.
        """
        full_env = {**self.cluster.env, **(env or {})}
        proc = ChildProcess(
            ["ip", "netns", "exec", self.netns, *argv], env=full_env, cwd=self.cluster.cwd
        )
        self.cluster.procs.append(proc)
        return proc.wait_ready(timeout) if ready else proc

    def python(
        self, *args: str, env: Mapping[str, str] | None = None, ready: bool = True,
        timeout: float = 30.0,
    ) -> ChildProcess:
        """``spawn([sys.executable, *args])``."""
        return self.spawn([sys.executable, *args], env=env, ready=ready, timeout=timeout)

    def run(
        self, argv: Sequence[str], *, timeout: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside this host to completion (stdout and stderr captured)."""
        return subprocess.run(
            ["ip", "netns", "exec", self.netns, *argv], capture_output=True, text=True,
            timeout=timeout, env={**self.cluster.env}, cwd=self.cluster.cwd, check=False,
        )

    def pids(self) -> list[int]:
        """Every process inside this host's namespace."""
        return [int(p) for p in ip("netns", "pids", self.netns, check=False).split()]

    def uds(self, port: int) -> str:
        """A Unix socket (a path) forwarded to ``127.0.0.1:port`` inside this host, for clients
        in other namespaces (the test process). Started once per port."""
        proc = self._forwards.get(port)
        if proc is None or not proc.running():
            path = str(Path(self.cluster.tmp) / f"{self.name}-{port}.sock")
            proc = self.python("-m", "dynamo_zmq.tools.uds_forward", path, str(port))
            self._forwards[port] = proc
        return proc.address.removeprefix("unix:")

    def http(self, port: int = 8000) -> Any:
        """An HTTP client (openai's HTTP library: httpx, or httpx2 in newer releases) for
        ``http://127.0.0.1:port`` of this host, through ``uds``: ``host.http().get("/health")``.
        """
        import openai

        base = next(c for c in openai.DefaultHttpxClient.__mro__ if "openai" not in c.__module__)
        lib: Any = importlib.import_module(base.__module__.split(".")[0])
        transport = lib.HTTPTransport(uds=self.uds(port))
        return openai.DefaultHttpxClient(transport=transport, base_url=f"http://{self.name}")

    def openai_client(self, port: int = 8000, **kwargs: Any) -> openai.OpenAI:
        """An ``openai.OpenAI`` client for the frontend on ``port`` of this host (through
        ``uds``); ``kwargs`` go to ``openai.OpenAI`` (default: no retries, 30 s timeout)."""
        import openai

        opts: dict[str, Any] = {"api_key": "none", "max_retries": 0, "timeout": 30.0, **kwargs}
        return openai.OpenAI(
            base_url=f"http://{self.name}/v1", http_client=self.http(port), **opts
        )


class Cluster:
    """Hosts as network namespaces joined by a bridge in a namespace of its own.

    Args:
        hosts: host names (a lowercase letter, then up to 7 lowercase letters or digits).
        env: variables every process started in the cluster gets, on top of this process's
            environment without its ``DYN_*`` variables.
        cwd: the working directory of those processes.
        subnets: host name -> subnet index (0, 1, ...), or several (a multi-homed host, one
            link on each); hosts not named are on subnet 0. Several subnets are joined by a
            router that forwards no multicast, unless ``routed`` is False.

    Raises:
        ValueError: a host name is malformed, repeated, or there are more than 250 hosts
            (on one subnet), or a host's subnets are none or repeated.
    """

    def __init__(
        self,
        hosts: Iterable[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        subnets: Mapping[str, int | Sequence[int]] | None = None,
        routed: bool = True,
    ) -> None:
        names = list(hosts)
        bad = [n for n in names if not _HOST_NAME.match(n)]
        on = {n: _indexes((subnets or {}).get(n, 0)) for n in names}
        count = max((k for ks in on.values() for k in ks), default=0) + 1
        per = [sum(k in ks for ks in on.values()) for k in range(count)]
        if (bad or len(set(names)) != len(names) or not names or max(per) > 250 or count > 16
                or any(not ks or len(set(ks)) != len(ks) for ks in on.values())):
            raise ValueError(f"host names must be distinct [a-z][a-z0-9]{{0,7}}, at most 250 "
                             f"a subnet, each on distinct subnets, got {names!r}, {subnets!r}")
        self.id = secrets.token_hex(3)
        second, third = 18 + secrets.randbelow(2), secrets.randbelow(240)
        #: One /24 per subnet; ``subnet`` is the first (every host's without ``subnets``).
        self.subnets = [ipaddress.IPv4Network(f"198.{second}.{third + k}.0/24")
                        for k in range(count)]
        self.subnet = self.subnets[0]
        self.bridge_netns = f"dz{self.id}-br"
        #: The router's namespace (several subnets, ``routed``, only).
        self.router_netns = f"dz{self.id}-rt" if count > 1 and routed else None
        base = {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}
        self.env: dict[str, str] = {**base, **(env or {})}
        self.cwd = cwd
        self.procs: list[ChildProcess] = []
        self.hosts: dict[str, Host] = {}
        taken = [0] * count
        for i, name in enumerate(names, start=1):
            for n, k in enumerate(on[name]):
                taken[k] += 1
                address, port = str(self.subnets[k][taken[k]]), f"p{i}" + f"x{n}" * (n > 0)
                host = self.hosts.get(name)
                if host is None:
                    self.hosts[name] = Host(self, name, f"dz{self.id}-{name}", address, port, k)
                else:
                    host.addresses.append(address)
                    host.ports.append(port)
                    host.on.append(k)
        self._made: list[str] = []
        self.tmp = ""

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> None:
        """Create the bridge and every host. Raises ClusterError (call ``close`` after)."""
        self.tmp = tempfile.mkdtemp(prefix=f"dz{self.id}-")
        br = self.bridge_netns
        self._add_netns(br)
        for k in range(len(self.subnets)):
            ip("-n", br, "link", "add", _bridge_name(k), "type", "bridge", "mcast_snooping", "0")
            ip("-n", br, "link", "set", _bridge_name(k), "up")
        prefix = str(self.subnet.prefixlen)
        for host in self.hosts.values():
            ns = host.netns
            self._add_netns(ns)
            for n, (address, port, k) in enumerate(zip(host.addresses, host.ports, host.on,
                                                       strict=True)):
                iface = f"eth{n}"  # HOST_IFACE first
                ip("link", "add", iface, "netns", ns, "type", "veth",
                   "peer", "name", port, "netns", br)
                ip("-n", br, "link", "set", port, "master", _bridge_name(k), "up")
                ip("-n", ns, "addr", "add", f"{address}/{prefix}", "dev", iface)
                ip("-n", ns, "link", "set", iface, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        if self.router_netns is not None:
            self._start_router(self.router_netns)

    def _start_router(self, rt: str) -> None:
        """A router on every subnet (their ``.254``) forwarding unicast between them, and every
        host's default route through it. Linux forwards no multicast without a multicast
        routing daemon: mDNS stays on its subnet, as on a routed network."""
        self._add_netns(rt)
        ip("-n", rt, "link", "set", "lo", "up")
        for k, net in enumerate(self.subnets):
            ip("link", "add", f"e{k}", "netns", rt, "type", "veth",
               "peer", "name", f"r{k}", "netns", self.bridge_netns)
            ip("-n", self.bridge_netns, "link", "set", f"r{k}", "master", _bridge_name(k), "up")
            ip("-n", rt, "addr", "add", f"{net[254]}/{net.prefixlen}", "dev", f"e{k}")
            ip("-n", rt, "link", "set", f"e{k}", "up")
        done = subprocess.run(["ip", "netns", "exec", rt, "sh", "-c",
                               "echo 1 > /proc/sys/net/ipv4/ip_forward"],
                              capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise ClusterError(f"cannot turn forwarding on in {rt}: {done.stderr.strip()}")
        for host in self.hosts.values():
            ip("-n", host.netns, "route", "add", "default", "via",
               str(self.subnets[host.subnet][254]))

    def close(self) -> None:
        """Stop every process started in the cluster (by pid), kill what is left inside its
        namespaces, delete the namespaces it made. Idempotent."""
        for proc in reversed(self.procs):
            proc.stop(timeout=5.0)
        self.procs.clear()
        for ns in self._made:
            for pid in ip("netns", "pids", ns, check=False).split():
                with contextlib.suppress(ProcessLookupError):  # a child of a process we started
                    os.kill(int(pid), signal.SIGKILL)
        for ns in reversed(self._made):
            ip("netns", "del", ns, check=False)
        self._made.clear()
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = ""

    def cut(self, host: Host, *, silent: bool = False) -> None:
        """Cut ``host`` off: nothing reaches it or leaves it.

        By default its bridge port goes down, so its link loses carrier (a pulled cable).
        ``silent=True`` disables the port instead: frames are dropped and the link stays up
        (a dead switch upstream, a firewall dropping everything), so connection attempts hang
        rather than fail.
        """
        for port in host.ports:
            if silent:
                _bridge("-n", self.bridge_netns, "link", "set", "dev", port, "state", "0")
            else:
                ip("-n", self.bridge_netns, "link", "set", port, "down")

    def heal(self, host: Host) -> None:
        """Undo ``cut``: ``host``'s bridge ports up and forwarding."""
        for port in host.ports:
            ip("-n", self.bridge_netns, "link", "set", port, "up")
        # A port set up a moment ago may not be running yet, and the bridge refuses to set the
        # state of a port that is not ("Network is down"); once running it forwards anyway.
        deadline = time.monotonic() + 5.0
        for port in host.ports:
            while True:
                try:
                    _bridge("-n", self.bridge_netns, "link", "set", "dev", port, "state", "3")
                    break
                except ClusterError as exc:
                    if "Network is down" not in str(exc) or time.monotonic() > deadline:
                        raise
                time.sleep(0.05)

    def freeze(self, host: Host) -> None:
        """SIGSTOP every process inside ``host``."""
        for pid in host.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

    def thaw(self, host: Host) -> None:
        """SIGCONT every process inside ``host``."""
        for pid in host.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def _add_netns(self, name: str) -> None:
        ip("netns", "add", name)
        self._made.append(name)
