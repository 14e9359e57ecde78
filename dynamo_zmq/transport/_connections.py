"""This process's TCP connections as the kernel sees them: find them and end one.

libzmq offers no call to drop one peer of a bound socket. It does tell which file descriptor
a message came from (``ZMQ_SRCFD``), and ``/proc`` lists every established connection of
this process with its local port and its peer. ``shut_down`` ends one connection with
``shutdown(2)`` on a duplicate of its descriptor: libzmq sees the connection end as if the
peer had closed it, and closes the descriptor itself (it stays libzmq's; we never close it).
A descriptor is re-checked against the connection's addresses first, so one that was closed
and reused meanwhile is left alone. Linux only (elsewhere nothing is found).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import sys
from collections.abc import Collection
from dataclasses import dataclass

__all__ = ["Connection", "established", "of_fd", "shut_down", "shut_down_all"]

_ESTABLISHED = "01"


@dataclass(frozen=True)
class Connection:
    """One TCP connection: its descriptor here, and (ip, port) at each end."""

    fd: int
    local: tuple[str, int]
    peer: tuple[str, int]


def _ip(text: str) -> str:
    """An address of ``/proc/net/tcp{,6}`` (hex, 32-bit words in host order) as text."""
    raw = b"".join(int(text[i:i + 8], 16).to_bytes(4, sys.byteorder)
                   for i in range(0, len(text), 8))
    addr = ipaddress.ip_address(raw)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


def _endpoint(text: str) -> tuple[str, int]:
    ip, _, port = text.partition(":")
    return _ip(ip), int(port, 16)


def _socket_fds() -> dict[int, int]:
    """Socket inode -> descriptor, for every socket this process holds."""
    found: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            found[int(target[8:-1])] = int(name)
    return found


def established(ports: Collection[int], peers: Collection[str] | None = None) -> list[Connection]:
    """This process's established connections whose local port is one of ``ports`` (and whose
    peer's address is one of ``peers``, when given)."""
    if not ports:
        return []
    fds = _socket_fds()
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) < 10 or cols[3] != _ESTABLISHED:
                continue
            local, peer = _endpoint(cols[1]), _endpoint(cols[2])
            fd = fds.get(int(cols[9]))
            if fd is None or local[1] not in ports or (peers is not None and peer[0] not in peers):
                continue
            found.append(Connection(fd, local, peer))
    return found


def _addresses(sock: socket.socket) -> tuple[tuple[str, int], tuple[str, int]]:
    local, peer = sock.getsockname(), sock.getpeername()
    return (local[0], local[1]), (peer[0], peer[1])


def _dup(fd: int) -> socket.socket | None:
    try:
        return socket.socket(fileno=os.dup(fd))
    except OSError:
        return None


def of_fd(fd: int) -> Connection | None:
    """The connection behind descriptor ``fd`` now (None: not a connected socket)."""
    sock = _dup(fd)
    if sock is None:
        return None
    with sock:
        try:
            local, peer = _addresses(sock)
        except (OSError, IndexError):
            return None
    return Connection(fd, local, peer)


def shut_down(conn: Connection) -> bool:
    """End ``conn`` if its descriptor still holds that very connection; True if it did."""
    sock = _dup(conn.fd)
    if sock is None:
        return False
    with sock:
        try:
            if _addresses(sock) != (conn.local, conn.peer):
                return False  # closed, and the number reused for another socket
            sock.shutdown(socket.SHUT_RDWR)
        except (OSError, IndexError):
            return False
    return True


def shut_down_all(conns: Collection[Connection]) -> int:
    """``shut_down`` each; how many were ended."""
    ended = 0
    for conn in conns:
        with contextlib.suppress(Exception):
            ended += shut_down(conn)
    return ended
