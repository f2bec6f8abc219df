"""A stage's state as bytes: read from a checkpoint's shards for an assignment, and the outer blob.

A stage resumed or recovered reads its tensors from the checkpoint's shards itself (the
coordinator names the directory, it sends no weights); in hierarchical mode the state a checkpoint
and a re-plan keep is the outer weights and momentum, with the stage's tensors no outer step
touches (buffers, frozen weights). Both are safetensors, the same bytes for every backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from safetensors.numpy import save as st_save

from fusionllm.core.errors import FusionError
from fusionllm.graph.ir import OpGraph
from fusionllm.runtime.stage.outer import OuterState
from fusionllm.runtime.stage.stage_runtime import StageRuntime
from fusionllm.schedule.plan import Plan
from fusionllm.transport.shards import read_selected, stage_keep


def read_stage_shards(directory: str, graph: OpGraph, plan: Plan, worker: int) -> bytes:
    """The tensors of ``worker``'s stage, from the checkpoint in ``directory``, as safetensors."""
    paths = sorted(Path(directory).glob("stage-*.safetensors"))
    if not paths:
        raise FusionError(f"checkpoint {directory} has no shards this worker can read (a directory shared by every machine is needed)")
    stage = plan.stage_of_worker(worker)
    names = set(plan.stage_params(graph, stage.index))
    return read_selected(paths, stage_keep(names))


def outer_blob(runtime: StageRuntime, outer: OuterState) -> bytes:
    """The outer weights and momentum, and the stage's tensors no outer step touches (buffers,
    frozen weights: this group's), as safetensors (NumPy: the same bytes as every backend's)."""
    tensors: dict[str, Any] = {k: runtime.backend.to_host(v) for k, v in runtime.state_tensors().items()
                               if k.startswith("param/") and k.removeprefix("param/") not in outer.anchor}
    tensors.update(outer.outer_tensors())
    return st_save(tensors)
