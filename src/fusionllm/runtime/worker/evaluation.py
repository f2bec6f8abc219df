"""A worker's part of an ``Evaluate``: the forward-only program over each validation batch.

Every worker of the pipeline runs its stage's forward-only program (``StageRuntime.run_eval``) on
each validation batch, its tensors tagged with a negative step number no training step uses; the
stage that holds the loss reports it per micro-batch, and the stage that makes the model's output
computes the task's metric there with its own copy of the targets. In hierarchical mode the
coordinator may ask for the outer weights' loss: they are put in for the evaluation and the local
ones back after.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

import numpy as np

from fusionllm.core.logging import get_logger
from fusionllm.runtime.stage.outer import OuterState
from fusionllm.runtime.stage.stage_runtime import StageRuntime
from fusionllm.runtime.stage.step import StepFailure
from fusionllm.transport.control import Evaluate, Evaluated

log = get_logger("worker", "worker")

Metric = Callable[[int, Mapping[str, Any]], float | None]  # (micro-batch, the stage's tensors) -> the task's metric


async def evaluate(
    runtime: StageRuntime, req: Evaluate, inputs: Callable[[int], Awaitable[dict[int, dict[str, Any]]]],
    metric: Callable[[int], Metric | None], cancellable: Callable[[Coroutine[Any, Any, Any]], Awaitable[Any]],
    *, outer: OuterState | None = None,
) -> dict[str, Any]:
    """``req.batches`` validation batches from ``req.first`` (``inputs(j)``: batch j as the stage's micro-batches), each
    run as a task ``cancellable`` hands to the coordinator's Abort; the wire form of ``Evaluated``."""
    if outer is None:
        return await _batches(runtime, req, inputs, metric, cancellable)
    names = sorted(outer.anchor)
    local = await asyncio.to_thread(runtime.backend.get_params, names)
    await asyncio.to_thread(runtime.backend.set_params, outer.anchor_of(names))
    try:
        return await _batches(runtime, req, inputs, metric, cancellable)
    finally:
        await asyncio.to_thread(runtime.backend.set_params, local)


async def _batches(
    runtime: StageRuntime, req: Evaluate, inputs: Callable[[int], Awaitable[dict[int, dict[str, Any]]]],
    metric: Callable[[int], Metric | None], cancellable: Callable[[Coroutine[Any, Any, Any]], Awaitable[Any]],
) -> dict[str, Any]:
    out = Evaluated()
    for j in range(req.first, req.first + req.batches):
        fed = await inputs(j)
        try:
            done = await cancellable(runtime.run_eval(-(req.at_step * 1000 + j + 1), fed, metric(j)))
        except StepFailure as exc:
            log.error("evaluation: %s", exc)
            return Evaluated(failed=exc.message()).to_wire()
        if done is None:  # aborted
            return Evaluated().to_wire()
        losses, metrics = done
        if losses:
            out.losses[str(j)] = {str(mb): v for mb, v in losses.items()}
        if metrics:
            out.metrics[str(j)] = {str(mb): v for mb, v in metrics.items()}
    return out.to_wire()


def task_metric(runtime: StageRuntime, data_source: Any, j: int) -> Metric | None:
    """A task's metric on validation batch ``j``, computed by the stage that makes the model's
    output, with the targets from this worker's own copy of the batch (None: no metric here)."""
    task = getattr(data_source, "task", None)
    graph = runtime.graph
    if task is None or task.metric is None or not graph.outputs:
        return None
    out = graph.outputs[0]
    if not any(e.id == out for n in runtime.executor.nodes for e in n.outputs):
        return None
    targets = data_source.eval_batch(j)[task.inputs :]
    size = targets[0].shape[0] // runtime.plan.micro_batches

    def value(mb: int, tensors: Mapping[str, Any]) -> float | None:
        if out not in tensors:
            return None
        rows = [runtime.backend.from_host(np.ascontiguousarray(a[mb * size : (mb + 1) * size]), a.dtype.name) for a in targets]
        return float(task.metric(tensors[out], *rows))

    return value
