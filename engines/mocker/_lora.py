"""The mocker's LoRA adapters (``--enable-lora``): the registry of loaded adapters, and per
data-parallel rank the adapters resident "on the GPU".

An adapter is a directory in peft's format: its ``adapter_config.json`` gives its rank ``r``
(weights are not read: the mocker computes nothing). Loading one checks the path and the rank
(``--max-lora-rank``) and registers it; it becomes resident on a rank only when a request needs
it there. At most ``--max-loras`` adapters are resident per rank; a request for a non-resident
one evicts the least recently used adapter no running request uses (or waits until one is
free) and then waits the simulated load (``--lora-load-delay``, divided by
``--speedup-ratio``) before its prefill. Requests for one adapter share its load.
"""

from __future__ import annotations

import asyncio
import collections
import json
from pathlib import Path

from dynamo_zmq import errors
from dynamo_zmq.context import Context

__all__ = ["ADAPTER_CONFIG", "Adapters", "ResidentAdapters", "parse_lora_modules", "read_rank"]

#: peft's adapter configuration file, in every adapter directory.
ADAPTER_CONFIG = "adapter_config.json"


def read_rank(path: str) -> int:
    """The rank ``r`` of the peft adapter in directory ``path``.

    Raises:
        InvalidArgument: ``path`` is not a directory with a readable ``adapter_config.json``
            holding a positive integer ``r``.
    """
    root = Path(path)
    if not root.is_dir():
        raise errors.InvalidArgument(f"LoRA adapter path {path!r} is not a directory")
    config = root / ADAPTER_CONFIG
    try:
        data = json.loads(config.read_text())
    except FileNotFoundError:
        raise errors.InvalidArgument(
            f"LoRA adapter path {path!r} has no {ADAPTER_CONFIG} (peft's adapter format)"
        ) from None
    except (OSError, ValueError) as exc:
        raise errors.InvalidArgument(f"cannot read {config}: {exc}") from exc
    rank = data.get("r") if isinstance(data, dict) else None
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise errors.InvalidArgument(f"{config} has no positive integer rank 'r'")
    return rank


def parse_lora_modules(items: list[str] | tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """``NAME=PATH`` items (``--lora-modules``) as (name, path) pairs.

    Raises:
        ValueError: an item is not ``NAME=PATH``, or a name repeats.
    """
    pairs: list[tuple[str, str]] = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules expects NAME=PATH items, got {item!r}")
        if any(n == name for n, _ in pairs):
            raise ValueError(f"--lora-modules names {name!r} twice")
        pairs.append((name, path))
    return tuple(pairs)


class Adapters:
    """The adapters loaded in the engine, name -> path (``LLMEngine.lora_adapters``)."""

    def __init__(self, max_rank: int) -> None:
        self.max_rank = max_rank
        self.loaded: dict[str, str] = {}

    def load(self, name: str, path: str) -> None:
        """Register adapter ``path`` as ``name`` (nothing changes on failure).

        Raises:
            InvalidArgument: ``name`` is loaded already, a bad path, or a rank above the max.
        """
        if name in self.loaded:
            raise errors.InvalidArgument(f"the LoRA adapter {name!r} is already loaded")
        rank = read_rank(path)
        if rank > self.max_rank:
            raise errors.InvalidArgument(
                f"LoRA rank {rank} of adapter {name!r} ({path}) is greater than "
                f"max_lora_rank {self.max_rank} (--max-lora-rank)"
            )
        self.loaded[name] = path

    def unload(self, name: str) -> None:
        """Forget adapter ``name`` (requests already running with it finish).

        Raises:
            NotFound: no adapter ``name`` is loaded.
        """
        if self.loaded.pop(name, None) is None:
            raise errors.NotFound(f"the LoRA adapter {name!r} is not loaded")


class ResidentAdapters:
    """The adapters resident on one rank (at most ``max_loras``, least recently used first)
    and the requests using each.

    Args:
        max_loras: adapters resident at once.
        load_seconds: the simulated load of a non-resident adapter.
    """

    def __init__(self, max_loras: int, load_seconds: float) -> None:
        self.max_loras = max_loras
        self.load_seconds = load_seconds
        #: Resident (or loading) adapter -> requests using it, least recently used first.
        self._users: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._loading: dict[str, asyncio.Task[None]] = {}
        self._freed = asyncio.Event()
        #: Simulated loads and evictions so far.
        self.loads = 0
        self.evictions = 0

    def resident(self) -> list[str]:
        """The resident adapters, least recently used first (loading ones included)."""
        return list(self._users)

    async def acquire(self, name: str) -> None:
        """Make ``name`` resident (loading it, evicting another, or waiting for a slot) and
        count one more request using it; ``release`` undoes the count. Cancellable."""
        while True:
            loading = self._loading.get(name)
            if loading is not None:
                await asyncio.shield(loading)
                continue
            if name in self._users:
                self._users[name] += 1
                self._users.move_to_end(name)
                return
            if len(self._users) >= self.max_loras:
                victim = next((n for n, users in self._users.items()
                               if not users and n not in self._loading), None)
                if victim is None:  # every slot is in use: wait for a release
                    self._freed.clear()
                    await self._freed.wait()
                    continue
                del self._users[victim]
                self.evictions += 1
            self._users[name] = 0
            self._loading[name] = asyncio.ensure_future(self._load(name))

    async def _load(self, name: str) -> None:
        try:
            await asyncio.sleep(self.load_seconds)
            self.loads += 1
        finally:
            del self._loading[name]

    async def acquire_unless_stopped(self, name: str, ctx: Context) -> bool:
        """``acquire`` for a request, unless ``ctx`` is stopped first; whether it acquired."""
        acquire = asyncio.ensure_future(self.acquire(name))
        stopped = asyncio.ensure_future(ctx.stopped())
        try:
            await asyncio.wait((acquire, stopped), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not acquire.done():
                acquire.cancel()
        return acquire.done() and not acquire.cancelled() and acquire.exception() is None

    def release(self, name: str) -> None:
        """One request using ``name`` ended."""
        users = self._users.get(name)
        if users:
            self._users[name] = users - 1
            if users == 1:
                self._freed.set()

    def close(self) -> None:
        """Cancel the loads in flight."""
        for task in list(self._loading.values()):
            task.cancel()
