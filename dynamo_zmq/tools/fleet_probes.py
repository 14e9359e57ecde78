"""Readings a fleet run takes of its processes and hosts, from ``/proc`` and ``/metrics``.

A process's CPU seconds and resident memory come from ``/proc/PID/stat`` and ``status``. A
host's traffic comes from the counters of its network namespace, read through any process in
it (``/proc/PID/net/...`` shows the namespace PID lives in): multicast packets and bytes
(``IpExt``; mDNS is the only multicast traffic of a fleet), UDP datagrams (``Udp``, mDNS's
unicast answers too) and the bytes on ``eth0``. A frontend's series come from its ``/metrics``
text; ``quantile`` reads a percentile off the difference of two histogram scrapes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

__all__ = [
    "HostCounters",
    "MetricSamples",
    "ProcUsage",
    "host_counters",
    "parse_metrics",
    "proc_usage",
    "quantile",
    "rate",
    "total",
]

_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcUsage:
    """One process at one moment: CPU seconds so far (user + system) and resident bytes."""

    cpu: float
    rss: int


def proc_usage(pid: int) -> ProcUsage:
    """``pid``'s usage now (raises OSError when it is gone)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read().rsplit(")", 1)[1].split()
    cpu = (int(stat[11]) + int(stat[12])) / _TICKS  # utime, stime (fields 14 and 15)
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
                break
    return ProcUsage(cpu, rss)


@dataclass(frozen=True)
class HostCounters:
    """A network namespace's traffic counters (totals since it was made)."""

    mcast_in_pkts: int = 0
    mcast_out_pkts: int = 0
    mcast_in_bytes: int = 0
    mcast_out_bytes: int = 0
    udp_in: int = 0
    udp_out: int = 0
    #: UDP datagrams dropped because a socket's receive buffer was full.
    udp_rcvbuf_errors: int = 0
    eth_rx_bytes: int = 0
    eth_tx_bytes: int = 0

    def __sub__(self, other: HostCounters) -> HostCounters:
        return HostCounters(**{f.name: getattr(self, f.name) - getattr(other, f.name)
                               for f in fields(self)})


def _table(path: str, prefix: str) -> dict[str, int]:
    """The ``prefix:`` header and value lines of a ``/proc/net/snmp``-style file."""
    with open(path) as f:
        rows = [line.split() for line in f if line.startswith(prefix + ":")]
    head, values = rows[0][1:], rows[1][1:]
    return dict(zip(head, (int(v) for v in values), strict=True))


def host_counters(pid: int, iface: str = "eth0") -> HostCounters:
    """The counters of the network namespace ``pid`` is in (raises OSError when it is gone)."""
    ipext = _table(f"/proc/{pid}/net/netstat", "IpExt")
    udp = _table(f"/proc/{pid}/net/snmp", "Udp")
    rx = tx = 0
    with open(f"/proc/{pid}/net/dev") as f:
        for line in f:
            name, sep, rest = line.partition(":")
            if sep and name.strip() == iface:
                cols = rest.split()
                rx, tx = int(cols[0]), int(cols[8])
    return HostCounters(
        mcast_in_pkts=ipext["InMcastPkts"], mcast_out_pkts=ipext["OutMcastPkts"],
        mcast_in_bytes=ipext["InMcastOctets"], mcast_out_bytes=ipext["OutMcastOctets"],
        udp_in=udp["InDatagrams"], udp_out=udp["OutDatagrams"],
        udp_rcvbuf_errors=udp["RcvbufErrors"], eth_rx_bytes=rx, eth_tx_bytes=tx,
    )


#: ``{(sample name, frozenset of label items): value}`` of one ``/metrics`` scrape.
MetricSamples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_metrics(text: str) -> MetricSamples:
    """Every sample of a Prometheus text scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    out: MetricSamples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def total(samples: MetricSamples, name: str) -> float:
    """The sum of every series named ``name`` (all label values)."""
    return sum(v for (n, _), v in samples.items() if n == name)


def rate(before: MetricSamples, after: MetricSamples, name: str, seconds: float) -> float:
    """Per-second increase of the series ``name`` (summed over labels) between two scrapes."""
    return (total(after, name) - total(before, name)) / seconds if seconds > 0 else 0.0


def quantile(before: MetricSamples, after: MetricSamples, name: str, q: float) -> float | None:
    """The ``q`` quantile of histogram ``name`` over what it observed between two scrapes
    (summed over every label but ``le``), interpolated linearly inside the bucket as
    Prometheus's ``histogram_quantile`` does; None when nothing was observed."""
    buckets: dict[float, float] = {}
    for (n, labels), value in after.items():
        if n != f"{name}_bucket":
            continue
        le = float(dict(labels)["le"])
        buckets[le] = buckets.get(le, 0.0) + value - before.get((n, labels), 0.0)
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == float("inf"):
                return lower  # past the last finite bucket: its bound is all we know
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 0.0)
        lower, below = bound, count
    return lower
