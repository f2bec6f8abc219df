"""The step (or evaluation) a worker runs now: one task, which the coordinator's Abort cancels.

The coordinator link reads it too (a restarted coordinator: let the step in flight end before
joining again), so it is a part of its own that both are given.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any


class Running:
    """The program running now, as a task the coordinator's Abort can cancel."""

    def __init__(self) -> None:
        self.task: asyncio.Task | None = None

    async def run(self, work: Coroutine[Any, Any, Any]) -> Any:
        """Run ``work`` as the current task; None when an Abort cancelled it (not when the caller was cancelled)."""
        task = asyncio.create_task(work)
        self.task = task
        try:
            return await task
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if task.cancelled() and not (me is not None and me.cancelling()):  # aborted by the coordinator
                return None
            raise

    async def abort(self) -> bool:
        """Cancel the current task; whether one was running."""
        task, self.task = self.task, None
        if task is None or task.done():
            return False
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        return True

    async def settle(self, bound: float) -> bool:
        """Wait up to ``bound`` seconds for the current task to end; False (and aborted) when it did not."""
        task = self.task
        if task is None or task.done():
            return True
        done, _ = await asyncio.wait({task}, timeout=bound)
        if not done:
            await self.abort()
            return False
        return True
