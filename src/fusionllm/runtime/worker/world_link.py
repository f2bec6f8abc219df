"""The worker's side of its world (``runtime/dist/collective.py``): formed on Assign, dropped on Abort,
on the next Assign and at exit. This module imports no framework: ``collective`` (torch) is
imported only when a torch worker is sent a process group.

Dropping never waits: an Abort must answer within seconds even when a collective of the aborted
step is still in flight (a hung peer keeps it there until the group's timeout); the teardown runs
in a thread, and the next formation waits for it. Calls that may block that long (forming, a
collective) run in daemon threads (``runtime/dist/threads.py``), so that one stuck call never holds the
worker's exit.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from fusionllm.core.errors import FusionError
from fusionllm.runtime.dist.threads import in_daemon_thread
from fusionllm.runtime.worker.worker_config import WorkerConfig, advertise_host
from fusionllm.transport.control import Collective


def _torch_world(spec: Collective, worker: int, join_host: str, own_host: str, timeout: float, device: str) -> Any:
    from fusionllm.runtime.dist.collective import World

    return World(spec, worker, join_host=join_host, own_host=own_host, timeout=timeout, device=device)


class WorldLink:
    """The torch.distributed world this worker is in (None while it is in none), and the one being torn down.

    ``make_world`` builds a world from (spec, worker, join host, own host, timeout, device); by default
    ``runtime/dist/collective.py``'s ``World`` (tests give a fake)."""

    def __init__(self, config: WorkerConfig, backend_name: str, make_world: Callable[..., Any] = _torch_world) -> None:
        self.config = config
        self.backend_name = backend_name
        self.make_world = make_world
        self.world: Any = None  # runtime.collective.World while this worker is in a process group
        self._leaving: asyncio.Future | None = None

    async def join(self, spec: Collective, worker: int, timeout: float) -> Any:
        """Form the process group the coordinator sent (blocks until every member has arrived)."""
        if self.backend_name != "torch":
            raise FusionError(f"worker {worker} runs {self.backend_name}: it cannot join a torch.distributed group")
        await self.left(timeout)
        world = self.make_world(spec, worker, self.config.join.rpartition(":")[0].strip("[]"), advertise_host(self.config),
                                timeout, self.config.device)
        try:
            await in_daemon_thread(world.form)
        except Exception as exc:
            self.world = world
            self.drop()
            if isinstance(exc, FusionError):
                raise
            raise FusionError(f"worker {worker}: forming process group {spec.group} with workers {spec.ranks} failed: {type(exc).__name__}: {exc}") from exc
        self.world = world
        return world

    def drop(self) -> None:
        """Stop using the process group now; destroy it in a thread."""
        world, self.world = self.world, None
        if world is None:
            return
        world.alive = False
        self._leaving = asyncio.ensure_future(asyncio.to_thread(world.leave))

    async def left(self, timeout: float) -> None:
        """Wait, up to ``timeout`` seconds, for an earlier process group to be destroyed."""
        leaving, self._leaving = self._leaving, None
        if leaving is None:
            return
        with contextlib.suppress(asyncio.TimeoutError, Exception):
            await asyncio.wait_for(asyncio.shield(leaving), timeout)
