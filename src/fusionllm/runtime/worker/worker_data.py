"""A worker's own batches: the same corpus, seed and batch rule as the coordinator's.

Batch ``i`` is a function of (corpus, seed, i) (``data/batching.py``), so a worker that can load
the corpus the run names builds the micro-batches its stage needs itself, and no token crosses the
coordinator. The coordinator sends the corpus's digest; a worker whose copy differs (another file,
another Python's standard library for the embedded default) says why and is fed by the
coordinator instead, so a run never trains two stages on different data.
"""

from __future__ import annotations

import numpy as np

from fusionllm.core.errors import DataError, FusionError
from fusionllm.data.batching import Batcher
from fusionllm.data.lm_tokens import load_lm_tokens
from fusionllm.transport.control import DataSpec


class WorkerData:
    def __init__(self, spec: DataSpec) -> None:
        self.spec = spec
        try:
            tokens = load_lm_tokens(spec.source, spec.tokenizer, spec.val_fraction)
        except (DataError, OSError) as exc:
            raise FusionError(f"cannot load the run's data {spec.source or '(embedded default)'}: {exc}") from None
        train, val = tokens.train, tokens.val
        if tokens.digest != spec.digest:
            raise FusionError(f"the data {spec.source or '(embedded default)'} differs from the coordinator's (another file or Python version)")
        self.train = Batcher(train, spec.batch_size, spec.seq_len, spec.seed)
        self.val = Batcher(val, spec.batch_size, spec.seq_len, spec.seed)

    def step(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        return self.train.arrays(step)

    def eval_batch(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self.val.eval_arrays(index, self.spec.eval_batches)


class TaskData:
    """A task's batches (``models/task.py``), made here from the task's name and the run's options."""

    def __init__(self, spec: DataSpec) -> None:
        from fusionllm.models.task import batch_digest, load_task, parse_options

        self.spec = spec
        try:
            self.task = load_task(spec.task or "", parse_options(spec.options))
            digest = self.task.digest or batch_digest(self.task)
        except Exception as exc:  # a user's task: whatever it raises means this worker cannot read its data
            raise FusionError(f"cannot make the run's task {spec.task!r} here: {type(exc).__name__}: {exc}") from None
        if digest != spec.digest:
            raise FusionError(f"the task {spec.task!r} gives other batches here than on the coordinator (another data file or version)")

    def step(self, step: int) -> tuple[np.ndarray, ...]:
        return self.task.batch(step)

    def eval_batch(self, index: int) -> tuple[np.ndarray, ...]:
        return self.task.val(index)


def try_worker_data(spec: DataSpec | None) -> tuple[WorkerData | TaskData | None, str]:
    """(the data, "own") or (None, why the coordinator must feed this worker)."""
    if spec is None:
        return None, "the coordinator sent no data spec"
    try:
        return (TaskData(spec) if spec.task else WorkerData(spec)), "own"
    except FusionError as exc:
        return None, str(exc)
