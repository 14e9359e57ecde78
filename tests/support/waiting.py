"""Wait for a condition on a client's view of the cluster, woken by peer changes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(client, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    """True once ``predicate()`` holds; False if it still does not after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        remaining = deadline - loop.time()
        if remaining <= 0:
            return False
        await client._pool.wait_changed(min(remaining, 0.1))
    return True
