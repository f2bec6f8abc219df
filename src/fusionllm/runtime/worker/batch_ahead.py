"""A step's inputs, the next step's batch read while the coordinator's round trip runs (issue 58, item 5).

A worker that reads its own data (``worker_data.py``) used to read a step's batch when that
step's command came, on the step's critical path (about 1 ms of gpt-micro's 16 x 128 step, a thread
hop included). Batches depend on the step's number alone, so once step N is done the worker starts
reading step N+1's, in a thread, while its reply travels to the coordinator and the next command
comes back; that command takes it when its step and stage match. Anything else (a retry of N, a
re-plan's new stage, a restart's other step) reads its own batch, and the guess is dropped: what a
step trains on is the same either way. A worker fed by the coordinator decodes what it was sent.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fusionllm.compress.wire import decode_array
from fusionllm.core.errors import FusionError

if TYPE_CHECKING:
    from fusionllm.runtime.stage.stage_runtime import StageRuntime
    from fusionllm.runtime.worker.worker_data import TaskData, WorkerData

Feeds = dict[int, dict[str, Any]]


def fed(runtime: StageRuntime, inputs: dict[str, dict[str, bytes]]) -> Feeds:
    """Micro-batches the coordinator sent (a worker that cannot read the run's data)."""
    stage = runtime.backend
    return {int(mb): {e: stage.from_host(*decode_array(b)) for e, b in feeds.items()} for mb, feeds in inputs.items()}


class BatchAhead:
    """At most one batch read ahead: for one step of one stage (its runtime) and one data source."""

    def __init__(self) -> None:
        self._ahead: tuple[tuple[StageRuntime, object, int], asyncio.Future[Feeds]] | None = None

    async def inputs(self, runtime: StageRuntime, step: int, sent: dict[str, dict[str, bytes]] | None, data: WorkerData | TaskData | None) -> Feeds:
        """Step ``step``'s micro-batches for ``runtime``: those ``sent``, else the batch read ahead
        where it is this one, else read now."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and (sent is not None or ahead[0][0] is not runtime or ahead[0][1] is not data or ahead[0][2] != step):
            drop(ahead[1])
            ahead = None
        if sent is not None:
            return fed(runtime, sent)
        if data is None:
            raise FusionError(f"step {step}: no batches (this worker reads no data and none were sent)")
        return await (ahead[1] if ahead is not None else asyncio.to_thread(lambda: runtime.feeds(*data.step(step))))

    def read(self, runtime: StageRuntime, step: int, data: WorkerData | TaskData | None) -> None:
        """Start reading step ``step``'s batch for ``runtime``, in a thread (a worker that reads its data)."""
        if self._ahead is not None:
            drop(self._ahead[1])
            self._ahead = None
        if data is not None:
            self._ahead = ((runtime, data, step), asyncio.ensure_future(asyncio.to_thread(lambda: runtime.feeds(*data.step(step)))))


def drop(read: asyncio.Future[Feeds]) -> None:
    """A read not taken: cancelled (a thread already running finishes on its own), any error it had dropped."""
    read.cancel()
    read.add_done_callback(lambda f: f.cancelled() or f.exception())
