"""The worker's side of its world (``runtime/collective.py``): formed on Assign, dropped on Abort,
on the next Assign and at exit. This module imports no framework: ``collective`` (torch) is
imported only when a torch worker is sent a process group.

Dropping never waits: an Abort must answer within seconds even when a collective of the aborted
step is still in flight (a hung peer keeps it there until the group's timeout); the teardown runs
in a thread, and the next formation waits for it. Calls that may block that long (forming, a
collective) run in daemon threads (``in_daemon_thread``), so that one stuck call never holds the
worker's exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

from fusionllm.core.errors import FusionError
from fusionllm.transport.control import Collective


class WorldLink:
    config: Any  # the worker's (WorkerConfig)
    backend: Any
    world: Any
    _world_leaving: asyncio.Future | None

    def _advertise_host(self) -> str: ...

    def _init_world(self) -> None:
        self.world = None  # runtime.collective.World while this worker is in a process group
        self._world_leaving = None

    async def _join_world(self, spec: Collective, worker: int, timeout: float) -> Any:
        """Form the process group the coordinator sent (blocks until every member has arrived)."""
        if self.backend.name != "torch":
            raise FusionError(f"worker {worker} runs {self.backend.name}: it cannot join a torch.distributed group")
        await self._world_left(timeout)
        from fusionllm.runtime.collective import World

        world = World(spec, worker, join_host=self.config.join.rpartition(":")[0].strip("[]"), own_host=self._advertise_host(),
                      timeout=timeout, device=self.config.device)
        try:
            await in_daemon_thread(world.form)
        except Exception as exc:
            self.world = world
            self._drop_world()
            if isinstance(exc, FusionError):
                raise
            raise FusionError(f"worker {worker}: forming process group {spec.group} with workers {spec.ranks} failed: {type(exc).__name__}: {exc}") from exc
        self.world = world
        return world

    def _drop_world(self) -> None:
        """Stop using the process group now; destroy it in a thread."""
        world, self.world = self.world, None
        if world is None:
            return
        world.alive = False
        self._world_leaving = asyncio.ensure_future(asyncio.to_thread(world.leave))

    async def _world_left(self, timeout: float) -> None:
        """Wait, up to ``timeout`` seconds, for an earlier process group to be destroyed."""
        leaving, self._world_leaving = self._world_leaving, None
        if leaving is None:
            return
        with contextlib.suppress(asyncio.TimeoutError, Exception):
            await asyncio.wait_for(asyncio.shield(leaving), timeout)


async def in_daemon_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a daemon thread of its own (``asyncio.to_thread``'s pool is waited for at exit)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if done.done():  # the awaiting task was cancelled (an Abort)
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(value)

    def work() -> None:
        try:
            value, error = fn(*args), None
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            value, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=work, name=getattr(fn, "__name__", "collective"), daemon=True).start()
    return await done
