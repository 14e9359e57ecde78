"""Where a process's endpoints are advertised and dialed (issue 33 item 3): ``endpoint_via``
(a multi-homed peer's other endpoints, at the address its request plane was reached at), a
KV-transfer ticket's addresses, and ``--advertise-host`` / ``DYN_ADVERTISE_HOST``. On namespace
hosts: ``tests/test_cluster_multihomed.py``."""

from __future__ import annotations

import ipaddress
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynamo_zmq import errors
from dynamo_zmq.discovery._mdns_addresses import local_ipv4
from dynamo_zmq.kv_transfer import Ticket
from dynamo_zmq.kv_transfer._client import reachable_endpoint
from dynamo_zmq.runtime import RuntimeConfig
from dynamo_zmq.transport import endpoint_via

ips = st.ip_addresses(v=4).map(str)
ports = st.integers(1, 65535)


@given(hosts=st.lists(ips, min_size=1, max_size=4, unique=True), host=ips, via=ips,
       port=ports, via_port=ports)
def test_an_endpoint_is_dialed_where_the_request_plane_was_reached(
    hosts: list[str], host: str, via: str, port: int, via_port: int
) -> None:
    endpoint = f"tcp://{host}:{port}"
    got = endpoint_via(endpoint, f"tcp://{via}:{via_port}", hosts)
    if host in hosts and via in hosts:
        assert got == f"tcp://{via}:{port}"  # the peer's own address, another of its own
    else:
        assert got == endpoint  # pinned, another host's, or reached by an address not its own


@pytest.mark.parametrize("endpoint", ["ipc:///tmp/x", "tcp://nocolon", "", "tcp://:5"])
def test_an_endpoint_that_is_not_tcp_host_port_is_left_alone(endpoint: str) -> None:
    assert endpoint_via(endpoint, "tcp://10.0.0.1:5", ["10.0.0.1", "10.1.0.1"]) == endpoint


def test_a_ticket_is_pulled_at_an_address_on_a_network_of_this_host() -> None:
    here = next(ip for ip in local_ipv4() if ipaddress.IPv4Address(ip).is_loopback)
    elsewhere = "203.0.113.7"  # TEST-NET-3: on no network of this host
    ticket = Ticket(transfer_endpoint=f"tcp://{elsewhere}:4000", transfer_id="t", num_blocks=1,
                    num_bytes=1, transfer_hosts=(elsewhere, here))
    assert reachable_endpoint(ticket) == f"tcp://{here}:4000"
    alone = Ticket(transfer_endpoint=f"tcp://{elsewhere}:4000", transfer_id="t", num_blocks=1,
                   num_bytes=1)
    assert reachable_endpoint(alone) == f"tcp://{elsewhere}:4000"  # one address: as given


def test_the_advertise_host_is_every_endpoints_address() -> None:
    config = RuntimeConfig(host="0.0.0.0", advertise_host="10.9.8.7")
    assert config.advertised_hosts() == ("10.9.8.7",) and config.bind_host == "0.0.0.0"
    env = RuntimeConfig.from_env({"DYN_ADVERTISE_HOST": "10.9.8.6"})
    assert env.advertised_hosts() == ("10.9.8.6",)


@pytest.mark.parametrize("bad", ["myhost", "10.0.0", "0.0.0.0", "224.0.0.251", "::1"])
def test_a_bad_advertise_host_is_a_clear_error(bad: str) -> None:
    with pytest.raises(errors.InvalidArgument, match="--advertise-host"):
        RuntimeConfig(advertise_host=bad)


def test_a_worker_with_a_bad_advertise_host_stops_with_one_line(tiny_model) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path",
         str(tiny_model), "--advertise-host", "not-an-ip"],
        capture_output=True, text=True, timeout=60,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "error: --advertise-host (DYN_ADVERTISE_HOST) must be an IPv4 address, got " \
        "'not-an-ip'" in res.stderr
