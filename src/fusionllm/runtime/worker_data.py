"""A worker's own batches: the same corpus, seed and batch rule as the coordinator's.

Batch ``i`` is a function of (corpus, seed, i) (``data/batching.py``), so a worker that can load
the corpus the run names builds the micro-batches its stage needs itself, and no token crosses the
coordinator. The coordinator sends the corpus's digest; a worker whose copy differs (another file,
another Python's standard library for the embedded default) says why and is fed by the
coordinator instead, so a run never trains two stages on different data.
"""

from __future__ import annotations

import hashlib

import numpy as np

from fusionllm.core.errors import DataError, FusionError
from fusionllm.data.batching import Batcher
from fusionllm.data.corpus import load_corpus
from fusionllm.transport.control import DataSpec


def corpus_digest(tokens: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(tokens).tobytes()).hexdigest()


class WorkerData:
    def __init__(self, spec: DataSpec) -> None:
        self.spec = spec
        try:
            train, val = load_corpus(spec.source).split(spec.val_fraction)
        except (DataError, OSError) as exc:
            raise FusionError(f"cannot load the run's data {spec.source or '(embedded default)'}: {exc}") from None
        if corpus_digest(train) != spec.digest:
            raise FusionError(f"the data {spec.source or '(embedded default)'} differs from the coordinator's (another file or Python version)")
        self.train = Batcher(train, spec.batch_size, spec.seq_len, spec.seed)
        self.val = Batcher(val, spec.batch_size, spec.seq_len, spec.seed)

    def step(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        return self.train.arrays(step)

    def eval_batch(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self.val.eval_arrays(index, self.spec.eval_batches)


def try_worker_data(spec: DataSpec | None) -> tuple[WorkerData | None, str]:
    """(the data, "own") or (None, why the coordinator must feed this worker)."""
    if spec is None:
        return None, "the coordinator sent no data spec"
    try:
        return WorkerData(spec), "own"
    except FusionError as exc:
        return None, str(exc)
