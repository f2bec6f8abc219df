"""Waiting for work while watching something else: a hung peer's heartbeat, a silent connection.

A call to a hung worker or a push on a silent link does not fail by itself: its connection stays
open. ``watched`` waits for the work and looks at something that does tell (a heartbeat's age, a
socket's last acknowledgement) every ``every`` seconds; an exception from the look ends the wait and
cancels the work.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def watched(work: Awaitable[Any], look: Callable[[], None], *, every: float = 1.0, until: float | None = None) -> Any:
    """``work``'s result. While it runs, ``look()`` is called every ``every`` seconds; what it raises is
    raised here, and the work is cancelled. ``until``: a ``time.monotonic()`` deadline, after which
    ``asyncio.TimeoutError`` is raised the same way."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            left = None if until is None else until - time.monotonic()
            if left is not None and left <= 0:
                raise asyncio.TimeoutError
            done, _ = await asyncio.wait({task}, timeout=every if left is None else min(every, left))
            if done:
                return task.result()
            look()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
