"""What the coordinator needs from the model and the data, without knowing either.

The coordinator plans and keeps the clock; it does not build models, trace them, time their ops or
read corpora. A ``RunTask`` does that for it, made by the layer above (``fusionllm.launch.task.LMTask``
for the language models of ``--model``), so ``control`` imports only the layers under it.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from fusionllm.core.config import TrainConfig
from fusionllm.cost.work import OpWork
from fusionllm.graph.ir import OpGraph
from fusionllm.transport.control import DataSpec
from fusionllm.transport.shards import TensorSource


class RunTask(Protocol):
    @property
    def items_per_row(self) -> int:
        """What one batch row counts for in tokens/s (a language model: its sequence length)."""
        ...

    @property
    def metric_name(self) -> str:
        """The name of the task's validation metric (``val_<name>`` in the metrics), if it has one."""
        ...

    def configure(self, train: TrainConfig) -> TrainConfig:
        """``train`` with the optimiser settings the task sets (lr, warmup, weight decay)."""
        ...

    def trace(self, micro_batch_size: int) -> OpGraph:
        """The model's OpGraph for micro-batches of this many rows."""
        ...

    def initial_state(self) -> bytes | TensorSource:
        """The freshly initialised weights (``param/<name>``): one safetensors blob, or a source that
        reads each stage's tensors when it is assigned (a checkpoint of ``--init-from``)."""
        ...

    def estimate(self, graph: OpGraph) -> dict[str, OpWork]:
        """Per-op work of ``graph``, calibrated on this machine."""
        ...

    def reference_flops(self) -> float:
        """The achieved matmul FLOP/s of one core here: device speeds are counted in these."""
        ...

    def data_spec(self, eval_batches: int) -> DataSpec:
        """Where workers read their batches, with the digest of the corpus they must find."""
        ...

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """Training batch ``step`` (tokens, targets): for workers that cannot read the data."""
        ...

    def eval_batch(self, index: int, eval_batches: int) -> tuple[np.ndarray, np.ndarray]:
        ...

    def eval_count(self, eval_batches: int) -> int:
        """How many whole validation batches an evaluation runs."""
        ...

    def refused_ops(self, backend: str, graph: OpGraph, node_ids: list[str]) -> list[str]:
        """Op keys among ``node_ids`` that a worker of ``backend`` refuses beyond its advertised kinds."""
        ...
