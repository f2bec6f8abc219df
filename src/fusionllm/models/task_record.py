"""The ``Task`` record itself (what a user brings to train), apart from how tasks are found.

``models/task.py`` finds and builds tasks (``load_task``), and the built-in tasks (``vision_task.py``)
make a ``Task``: both import it from here, so the registry can name a built-in task without an
import circle. See ``models/task.py`` for what each field means to a run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fusionllm.core.errors import ConfigError

Batch = tuple[np.ndarray, ...]  # (inputs ..., targets ...)
OPTIONS = ("model", "data", "seed", "batch_size", "seq_len", "image_size")


@dataclass
class Task:
    """What to train. Every callable must be a pure function of its arguments (and the factory's)."""

    model: Callable[[], nn.Module]  # called after torch.manual_seed(seed): the same weights everywhere
    train_batch: Callable[[int], Sequence[np.ndarray]]  # training batch i: (inputs ..., targets ...)
    val_batch: Callable[[int], Sequence[np.ndarray]]  # validation batch j (no augmentation)
    loss: Callable[..., torch.Tensor]  # loss(model output, *targets) -> scalar
    inputs: int = 1  # how many arrays of a batch the model takes (the rest are the loss's targets)
    val_batches: int = 8  # validation batches there are (an evaluation runs min(this, --eval-batches))
    names: Sequence[str] | None = None  # the batch arrays' names (default input0, ..., target0, ...)
    metric: Callable[..., torch.Tensor | float] | None = None  # metric(output, *targets), e.g. accuracy (higher is better)
    metric_name: str = "accuracy"
    items_per_row: int = 1  # what one batch row counts for in tokens/s (a language model's rows are seq_len tokens)
    lr: float | None = None  # the optimiser settings the task wants (None: the command line's)
    weight_decay: float | None = None
    warmup: int | None = None
    digest: str = ""  # identifies the data: a worker whose batches would differ is fed by the coordinator

    def batch(self, i: int) -> Batch:
        return _check(self.train_batch(i), "train_batch", i, self.inputs)

    def val(self, j: int) -> Batch:
        return _check(self.val_batch(j), "val_batch", j, self.inputs)

    def array_names(self, count: int) -> list[str]:
        if self.names is not None:
            if len(self.names) != count:
                raise ConfigError(f"the task names {len(self.names)} batch arrays but its batches hold {count}")
            return list(self.names)
        return [f"input{k}" for k in range(self.inputs)] + [f"target{k}" for k in range(count - self.inputs)]


def _check(batch: Sequence[np.ndarray], what: str, i: int, inputs: int) -> Batch:
    arrays = tuple(np.asarray(a) for a in batch)
    if len(arrays) <= inputs:
        raise ConfigError(f"task {what}({i}) gave {len(arrays)} arrays; it must give {inputs} input(s) and at least one target")
    rows = {a.shape[0] if a.ndim else None for a in arrays}
    if len(rows) != 1 or None in rows:
        raise ConfigError(f"task {what}({i}): every array needs the same number of rows (the batch), got shapes {[a.shape for a in arrays]}")
    return arrays
