"""The multi-host harness itself (``dynamo_zmq.tools.netns``): hosts reach each other over the
bridge, cut/heal and freeze/thaw do what they say, children get no ``DYN_*`` variable, and
everything is torn down by name and pid, also when the test body fails."""

from __future__ import annotations

import ipaddress
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cluster import cluster

SERVER = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 9000)); s.listen()
print("READY tcp://0.0.0.0:9000", flush=True)
while True:
    c, _ = s.accept(); c.sendall(b"hi"); c.close()
"""
CLIENT = """
import socket, sys
s = socket.create_connection((sys.argv[1], 9000), timeout=1.0); s.settimeout(1.0)
print(s.recv(2).decode())
"""


def reaches(host, address: str) -> bool:
    done = host.run([sys.executable, "-c", CLIENT, address], timeout=10)
    return done.returncode == 0 and done.stdout.strip() == "hi"


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_hosts_reach_each_other_until_cut_or_frozen(make_cluster) -> None:
    c = make_cluster("a", "b")
    a, b = c["a"], c["b"]
    assert a.address != b.address
    assert {ipaddress.IPv4Address(h.address) in c.subnet for h in (a, b)} == {True}
    server = a.spawn([sys.executable, "-c", SERVER])
    assert reaches(b, a.address)
    assert reaches(a, "127.0.0.1") and not reaches(b, "127.0.0.1")  # each has its own loopback
    c.cut(a)
    assert not reaches(b, a.address)
    c.heal(a)
    assert reaches(b, a.address)
    c.cut(a, silent=True)
    assert not reaches(b, a.address)
    c.heal(a)
    assert reaches(b, a.address)
    c.freeze(a)
    assert server.pid in a.pids() and state(server.pid) == "T"
    assert not reaches(b, a.address)
    c.thaw(a)
    assert state(server.pid) != "T"
    assert reaches(b, a.address)


def test_children_start_without_dyn_variables(make_cluster) -> None:
    a = make_cluster("a")["a"]
    code = "import os; print(sorted(k for k in os.environ if k.startswith('DYN_')))"
    assert a.run([sys.executable, "-c", code]).stdout.strip() == "[]"


def test_everything_is_torn_down_also_when_the_body_fails() -> None:
    with pytest.raises(RuntimeError, match="boom"), cluster("a", "b") as c:
        proc = c["a"].spawn([sys.executable, "-c", SERVER])
        c.freeze(c["a"])  # a frozen process must still be stopped
        made = [c.bridge_netns, *(h.netns for h in c.hosts.values())]
        raise RuntimeError("boom")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [ns for ns in made if ns in listed.split()]
    assert proc.popen.poll() is not None


def test_two_clusters_side_by_side_do_not_collide(make_cluster) -> None:
    one, two = make_cluster("a"), make_cluster("a")
    assert one["a"].netns != two["a"].netns and one.bridge_netns != two.bridge_netns
