"""The advert files of directory discovery: their name, their JSON, writing them atomically,
and what kind of filesystem holds them.

One file per (namespace, instance): ``<namespace label>-<instance id as 16 hex>.json`` (the
mDNS instance label), holding a ``DirAdvert`` as JSON. A writer writes a hidden temporary file
in the same directory and renames it over the name, so a reader sees the old file or the new,
never a part (rename is atomic on NFS, Lustre and GPFS as on a local disk).
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

import msgspec

from ._base import PROTOCOL_VERSION, Advert

__all__ = [
    "MAX_ADVERT_BYTES",
    "SUFFIX",
    "DirAdvert",
    "advert_file_name",
    "decode_advert",
    "encode_advert",
    "filesystem_type",
    "is_network_filesystem",
    "write_atomic",
]

SUFFIX = ".json"
#: An advert file larger than this is garbage (a real one is a few hundred bytes).
MAX_ADVERT_BYTES = 64 * 1024
#: Filesystems where inotify does not see other hosts' changes: readers poll them.
_NETWORK_FS = ("nfs", "lustre", "gpfs", "cifs", "smb", "ceph", "glusterfs", "beegfs", "9p",
               "panfs", "wekafs", "afs", "fuse")


class DirAdvert(msgspec.Struct, forbid_unknown_fields=False):
    """One advert file's content (JSON)."""

    v: int
    ns: str
    #: The instance id, 16 hex digits.
    iid: str
    #: ``tcp://host:port`` addresses of the instance's request plane.
    addresses: list[str]
    comps: list[str] = []
    #: The CURVE public key (Z85); empty when auth is off.
    key: str = ""
    #: Who wrote it (for people reading the directory).
    host: str = ""
    pid: int = 0


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(DirAdvert)


def advert_file_name(namespace: str, instance_id: int) -> str:
    """The file of one advert: a filesystem-safe namespace label plus the instance id."""
    safe = re.sub(r"[^A-Za-z0-9-]+", "-", namespace).strip("-")[:46].rstrip("-") or "ns"
    return f"{safe}-{instance_id:016x}{SUFFIX}"


def encode_advert(advert: Advert) -> bytes:
    return _encoder.encode(DirAdvert(
        v=advert.protocol_version, ns=advert.namespace, iid=f"{advert.instance_id:016x}",
        addresses=list(advert.addresses), comps=list(advert.components),
        key=advert.public_key, host=os.uname().nodename, pid=os.getpid(),
    ))


def decode_advert(data: bytes) -> DirAdvert:
    """The advert in a file's bytes.

    Raises:
        ValueError: not an advert (garbage, a truncated write, another version's layout).
    """
    if len(data) > MAX_ADVERT_BYTES:
        raise ValueError(f"{len(data)} bytes, over {MAX_ADVERT_BYTES}")
    try:
        advert = _decoder.decode(data)
        int(advert.iid, 16)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise ValueError(str(exc)) from exc
    if advert.v != PROTOCOL_VERSION:
        raise ValueError(f"protocol version {advert.v}, this process speaks {PROTOCOL_VERSION}")
    return advert


def write_atomic(directory: Path, name: str, data: bytes) -> None:
    """Write ``directory/name`` whole or not at all (a hidden temporary file, then rename).

    Raises:
        OSError: the directory cannot be written.
    """
    tmp = directory / f".{name}.{secrets.token_hex(4)}.tmp"
    try:
        tmp.write_bytes(data)
        os.replace(tmp, directory / name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def filesystem_type(path: str | Path) -> str:
    """The type of the filesystem ``path`` is on (``/proc/self/mountinfo``; '' if unknown)."""
    target = os.path.realpath(path)
    best, kind = -1, ""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                left, sep, right = line.partition(" - ")
                fields = left.split()
                if not sep or len(fields) < 5:
                    continue
                mount = fields[4].replace("\\040", " ")
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) > best:
                    best, kind = len(mount), right.split()[0] if right.split() else ""
    except OSError:
        return ""
    return kind


def is_network_filesystem(kind: str) -> bool:
    """Whether a filesystem of type ``kind`` is shared over the network (inotify sees only
    this host's changes there)."""
    return kind.startswith(_NETWORK_FS)
