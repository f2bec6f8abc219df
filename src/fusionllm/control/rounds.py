"""The round arithmetic of a hierarchical run, and a bounded wait on its condition.

Pure functions: which pauses write a checkpoint, which round a resumed run starts at.
"""

from __future__ import annotations

import asyncio


async def wait_notified(cond: asyncio.Condition, timeout: float) -> None:
    """``cond.wait()`` for at most ``timeout`` seconds; the caller holds ``cond``'s lock.

    Not ``asyncio.wait_for(cond.wait(), timeout)``: when the task is cancelled in the loop turn in
    which the wait was notified, Python 3.11's ``wait_for`` returns the result and the cancellation
    is lost, so a loop around it never ends (the coordinator's pauser hung that way when the last
    group finished). Here the timeout is a notification from a timer task, and a cancellation
    always reaches the caller."""

    async def wake() -> None:
        await asyncio.sleep(timeout)
        async with cond:
            cond.notify_all()  # the other waiters re-check their conditions: a spurious wake-up is harmless

    timer = asyncio.create_task(wake())
    try:
        await cond.wait()
    finally:
        timer.cancel()


def checkpoint_rounds(lengths: list[int], every: int) -> set[int]:
    """The pauses (round indices ``p``: before round ``p`` starts) at which a checkpoint is written:
    after the first round whose cumulative steps ``lengths`` reach each multiple of ``every``."""
    out, done = set(), 0
    for k, h in enumerate(lengths[:-1]):  # the run's end writes the last one
        if every and (done + h) // every > done // every:
            out.add(k + 1)
        done += h
    return out


def resume_round(lengths: list[int], step: int) -> int:
    """The round to start from when ``step`` steps (of the slowest group) are done."""
    done, k = 0, 0
    while k < len(lengths) and done + lengths[k] <= step:
        done += lengths[k]
        k += 1
    return k
