"""A routing-mode plugin whose routers never finish closing (``close`` waits for ever), so a
test can show that the frontend's shutdown is bounded. Registered as ``stuck-close`` by the
dist-info directory ``install_stuck_router`` writes (put it on the frontend's PYTHONPATH)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from dynamo_zmq.llm import ClientRouter, ModelRouter, RouterPlugin, RoutingTarget

__all__ = ["StuckClosePlugin", "install_stuck_router"]


class _StuckCloseRouter(ClientRouter):
    async def close(self) -> None:
        await asyncio.Event().wait()


class StuckClosePlugin(RouterPlugin):
    """Round-robin routers whose ``close`` never returns."""

    @classmethod
    def from_args(cls, mode: str, args: argparse.Namespace) -> StuckClosePlugin:
        return cls()

    async def router(self, target: RoutingTarget) -> ModelRouter:
        return _StuckCloseRouter(target.client)


def install_stuck_router(directory: Path) -> Path:
    """Write a distribution registering ``stuck-close`` under ``directory``; returns it."""
    info = directory / "dynzmq_stuck_router-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dynzmq-stuck-router\n"
                                   "Version: 0.0\n")
    (info / "entry_points.txt").write_text(
        "[dynamo_zmq.routers]\nstuck-close = tests.support.stuck_router:StuckClosePlugin\n")
    return directory
