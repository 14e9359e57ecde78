"""The rows the status tool shows for one peer (``dynamo_zmq.tools.status``, and its live view
``dynamo_zmq.tools.status_watch``): one per (namespace, component) it serves, from its
description, or one saying why it did not answer."""

from __future__ import annotations

from typing import Any

from ..discovery import PeerAdded
from ..llm import advert_of
from ..transport import PeerConnection, PeerState

__all__ = ["rows_of"]


def _row(
    address: str, state: str, hint: PeerAdded | None, instance_id: int | None = None
) -> dict[str, Any]:
    """The row of an instance that did not describe itself: what discovery said about it."""
    iid = instance_id if instance_id is not None else (hint.instance_id if hint else None)
    return {
        "namespace": hint.namespace if hint else None,
        "component": ",".join(hint.components) or None if hint else None,
        "endpoints": [],
        "instance_id": f"{iid:x}" if iid else None,
        "address": address,
        "age": None,
        "state": state,
        "hostname": None,
        "pid": None,
        "rev": None,
        "model": None,
        "role": None,
    }


def rows_of(
    conn: PeerConnection, hint: PeerAdded | None, namespace: str | None, now: float
) -> list[dict[str, Any]]:
    """The rows for one peer: one per (namespace, component) it serves, or one if it did not
    answer (``gone`` when the connection was refused or dropped, else ``unreachable``)."""
    desc = conn.description
    if desc is None:
        return [_row(conn.address, "gone" if conn.state is PeerState.DOWN else "unreachable", hint)]
    rows: list[dict[str, Any]] = []
    if hint is not None and hint.instance_id and hint.instance_id != desc.instance_id:
        # The advertised instance died and another one took its address.
        rows.append(_row(conn.address, "gone", hint))
    state = "draining" if conn.draining else conn.state.value
    groups: dict[tuple[str, str], list[str]] = {}
    models: dict[tuple[str, str], dict[str, str]] = {}  # group -> model name -> role
    for ep in desc.endpoints:
        if namespace is None or ep.namespace == namespace:
            groups.setdefault((ep.namespace, ep.component), []).append(ep.name)
            if (advert := advert_of(conn, ep.path)) is not None:
                models.setdefault((ep.namespace, ep.component), {})[advert.name] = advert.role
    if not groups and namespace is None:
        groups[("", "")] = []  # answering but serving nothing (yet): still worth a row
    age = max(0.0, now - desc.started_at)
    return rows + [
        {
            "namespace": ns or None,
            "component": comp or None,
            "endpoints": sorted(names),
            "instance_id": f"{desc.instance_id:x}",
            "address": conn.address,
            "age": round(age, 3),
            "state": state,
            "hostname": desc.hostname,
            "pid": desc.pid,
            "rev": desc.rev,
            "model": ",".join(sorted(models.get((ns, comp), {}))) or None,
            "role": ",".join(r for _, r in sorted(models.get((ns, comp), {}).items())) or None,
        }
        for (ns, comp), names in sorted(groups.items())
    ]
