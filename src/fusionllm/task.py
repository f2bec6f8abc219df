"""The language-model task the coordinator runs (``control.task.RunTask`` for ``--model``).

It builds the model from its spec and seed, traces it, times its ops on this machine, reads the
corpus and draws the batches: everything the coordinator needs from torch, models and data, kept
out of ``control`` so that the coordinator imports only the layers under it.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from fusionllm.core.config import TrainConfig
from fusionllm.core.errors import ConfigError
from fusionllm.cost.work import OpWork
from fusionllm.data import Batcher, ByteTokenizer, load_corpus
from fusionllm.graph.ir import OpGraph
from fusionllm.models.spec import build_model
from fusionllm.runtime.checkpoint import pack_tensors
from fusionllm.runtime.model_graph import graph_source, model_tensors, root_source, trace_lm
from fusionllm.runtime.profile import estimate, matmul_flops
from fusionllm.runtime.worker_data import corpus_digest
from fusionllm.transport.control import DataSpec

VAL_FRACTION = 0.1


class LMTask:
    def __init__(self, train: TrainConfig) -> None:
        self.train = train

    @functools.cached_property
    def model(self) -> torch.nn.Module:
        t = self.train
        model = build_model(t.model, ByteTokenizer().vocab_size, seed=t.seed)
        block = getattr(getattr(model, "config", None), "block_size", None)
        if isinstance(block, int) and t.seq_len > block:
            raise ConfigError(f"--seq-len {t.seq_len} exceeds the model's block size {block}")
        return model

    def trace(self, micro_batch_size: int) -> OpGraph:
        return trace_lm(self.model, micro_batch_size, self.train.seq_len, spec=self.train.model)

    def initial_state(self) -> bytes:
        return pack_tensors({f"param/{k}": v for k, v in model_tensors(self.model).items()})

    def estimate(self, graph: OpGraph) -> dict[str, OpWork]:
        return estimate(graph, source=graph_source(graph) or root_source(self.model), calibrate=True)

    def reference_flops(self) -> float:
        return matmul_flops("cpu", threads=1, seconds=0.5)

    @functools.cached_property
    def _batches(self) -> tuple[Batcher, Batcher, str]:
        t = self.train
        train_tokens, val_tokens = load_corpus(t.data).split(VAL_FRACTION)
        return Batcher(train_tokens, t.batch_size, t.seq_len, t.seed), Batcher(val_tokens, t.batch_size, t.seq_len, t.seed), corpus_digest(train_tokens)

    def data_spec(self, eval_batches: int) -> DataSpec:
        t = self.train
        return DataSpec(source=t.data, seed=t.seed, batch_size=t.batch_size, seq_len=t.seq_len, val_fraction=VAL_FRACTION,
                        digest=self._batches[2], eval_batches=eval_batches)

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        return self._batches[0].arrays(step)

    def eval_batch(self, index: int, eval_batches: int) -> tuple[np.ndarray, np.ndarray]:
        return self._batches[1].eval_arrays(index, eval_batches)

    def eval_count(self, eval_batches: int) -> int:
        return len(self._batches[1].eval_starts(eval_batches))

    def refused_ops(self, backend: str, graph: OpGraph, node_ids: list[str]) -> list[str]:
        if backend != "numpy":
            return []
        from fusionllm.npexec.executor import can_run

        return can_run(graph, node_ids)
