"""The tasks the coordinator runs (``control.task.RunTask``): ``LMTask`` for ``--task lm`` (the
language models of ``--model``), ``UserTask`` for any other ``fusionllm.Task`` (``--task vision``,
``--task package.module:factory``); ``run_task`` picks one.

They build the model from its spec and seed, trace it, time its ops on this machine, read the data
and draw the batches: everything the coordinator needs from torch, models and data, kept out of
``control`` so that the coordinator imports only the layers under it.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from fusionllm.core.config import TrainConfig
from fusionllm.core.errors import ConfigError
from fusionllm.cost.work import OpWork
from fusionllm.data import Batcher
from fusionllm.data.lm_tokens import LMTokens, load_lm_tokens
from fusionllm.graph.ir import OpGraph
from fusionllm.models.spec import build_lm, context_length, lm_tokenizer
from fusionllm.models.task import (
    Task,
    batch_digest,
    build_task_model,
    load_task,
    task_options,
    task_settings,
)
from fusionllm.runtime.backends.checkpoint import pack_tensors
from fusionllm.runtime.backends.model_graph import (
    graph_source,
    model_tensors,
    root_source,
    trace_lm,
    trace_task,
)
from fusionllm.runtime.backends.profile import estimate, matmul_flops
from fusionllm.transport.control import DataSpec
from fusionllm.transport.shards import TensorSource

VAL_FRACTION = 0.1


class _ModelTask:
    """What every task does the same way once it has its ``model``: initial weights, op timing, the
    NumPy backend's refusals."""

    model: torch.nn.Module

    def initial_state(self) -> bytes:
        return pack_tensors({f"param/{k}": v for k, v in model_tensors(self.model).items()})

    def estimate(self, graph: OpGraph) -> dict[str, OpWork]:
        return estimate(graph, source=graph_source(graph) or root_source(self.model), calibrate=True)

    def reference_flops(self) -> float:
        return matmul_flops("cpu", threads=1, seconds=0.5)

    def refused_ops(self, backend: str, graph: OpGraph, node_ids: list[str]) -> list[str]:
        if backend != "numpy":
            return []
        from fusionllm.npexec.executor import can_run

        return can_run(graph, node_ids)


class LMTask(_ModelTask):
    def __init__(self, train: TrainConfig) -> None:
        self.train = train

    @property
    def items_per_row(self) -> int:
        return self.train.seq_len

    @property
    def metric_name(self) -> str:
        return "perplexity"  # not computed in the pipeline: exp(val_loss)

    def configure(self, train: TrainConfig) -> TrainConfig:
        return train

    @functools.cached_property
    def model(self) -> torch.nn.Module:
        t = self.train
        if t.init_from:  # traced on the meta device; the weights are read by stage (initial_state)
            from fusionllm.models.hf import from_pretrained

            model = from_pretrained(t.init_from, vocab_size=self._tokens.vocab_size, weights=False)
        else:
            model = build_lm(t.model, self._tokens.vocab_size, seed=t.seed)
        block = context_length(model)
        if isinstance(block, int) and t.seq_len > block:
            raise ConfigError(f"--seq-len {t.seq_len} exceeds the model's block size {block}")
        return model

    def trace(self, micro_batch_size: int) -> OpGraph:
        return trace_lm(self.model, micro_batch_size, self.train.seq_len, spec=self.train.model)

    def initial_state(self) -> bytes | TensorSource:
        if self.train.init_from:  # each stage's tensors read from the checkpoint's files when that stage is assigned
            from fusionllm.models.hf import HFWeights

            return HFWeights(self.model, self.train.init_from)
        return super().initial_state()


    @functools.cached_property
    def tokenizer(self) -> str | None:
        return lm_tokenizer(self.train.tokenizer, self.train.init_from)

    @functools.cached_property
    def _tokens(self) -> LMTokens:
        return load_lm_tokens(self.train.data, self.tokenizer, VAL_FRACTION)

    @functools.cached_property
    def _batches(self) -> tuple[Batcher, Batcher, str]:
        t, tokens = self.train, self._tokens
        return Batcher(tokens.train, t.batch_size, t.seq_len, t.seed), Batcher(tokens.val, t.batch_size, t.seq_len, t.seed), tokens.digest

    def data_spec(self, eval_batches: int) -> DataSpec:
        t = self.train
        return DataSpec(source=t.data, seed=t.seed, batch_size=t.batch_size, seq_len=t.seq_len, val_fraction=VAL_FRACTION,
                        digest=self._batches[2], eval_batches=eval_batches, tokenizer=self.tokenizer)

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        return self._batches[0].arrays(step)

    def eval_batch(self, index: int, eval_batches: int) -> tuple[np.ndarray, np.ndarray]:
        return self._batches[1].eval_arrays(index, eval_batches)

    def eval_count(self, eval_batches: int) -> int:
        return len(self._batches[1].eval_starts(eval_batches))



class UserTask(_ModelTask):
    """Any ``fusionllm.Task`` as the coordinator's RunTask."""

    def __init__(self, train: TrainConfig) -> None:
        self.train = train
        self.batch_size = train.batch_size

    @property
    def items_per_row(self) -> int:
        return self.task.items_per_row

    @property
    def metric_name(self) -> str:
        return self.task.metric_name

    def configure(self, train: TrainConfig) -> TrainConfig:
        return task_settings(train, self.task)

    @functools.cached_property
    def task(self) -> Task:
        return load_task(self.train.task, task_options(self.train, self.batch_size))

    @functools.cached_property
    def model(self) -> torch.nn.Module:
        return build_task_model(self.task, self.train.seed)

    def trace(self, micro_batch_size: int) -> OpGraph:
        return trace_task(self.task, self.model, micro_batch_size,
                          source={"task": self.train.task, "options": task_options(self.train, self.batch_size)})


    @functools.cached_property
    def digest(self) -> str:
        return self.task.digest or batch_digest(self.task)

    def data_spec(self, eval_batches: int) -> DataSpec:
        t = self.train
        return DataSpec(source=t.data, seed=t.seed, batch_size=self.batch_size, seq_len=t.seq_len, val_fraction=0.0, digest=self.digest,
                        eval_batches=eval_batches, task=t.task, options={k: str(v) for k, v in task_options(t, self.batch_size).items()
                                                                         if v is not None})

    def batch(self, step: int) -> tuple[np.ndarray, ...]:
        return self.task.batch(step)

    def eval_batch(self, index: int, eval_batches: int) -> tuple[np.ndarray, ...]:
        return self.task.val(index)

    def eval_count(self, eval_batches: int) -> int:
        return min(eval_batches, self.task.val_batches)



def run_task(train: TrainConfig) -> LMTask | UserTask:
    """The coordinator's task for ``--task``."""
    return LMTask(train) if train.task == "lm" else UserTask(train)
