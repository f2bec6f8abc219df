"""Blocking calls of a world (forming it, a collective, a point-to-point message) in daemon threads.

``asyncio.to_thread``'s pool is waited for at exit, so one call stuck on a hung peer would hold the
worker's exit; a daemon thread of its own does not. This module imports no framework: the worker's
world link and the torch-only collectives both use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any


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
