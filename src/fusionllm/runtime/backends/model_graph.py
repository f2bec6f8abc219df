"""From a model spec to what the executor needs: the OpGraph, the tensors, the module source."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from fusionllm.core.errors import ConfigError
from fusionllm.graph import registry
from fusionllm.graph.ir import OpGraph
from fusionllm.graph.trace import trace
from fusionllm.models.loss import lm_loss
from fusionllm.models.spec import build_model
from fusionllm.models.task import Task


def trace_lm(
    model: nn.Module,
    batch_size: int,
    seq_len: int,
    *,
    vocab_size: int = 256,
    spec: str | None = None,
    **trace_kwargs: object,
) -> OpGraph:
    """Trace ``model`` with the LM loss on token batches of (batch_size, seq_len)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    idx = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
    targets = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
    source = {"model": spec, "vocab_size": vocab_size} if spec else None
    return trace(
        model, (idx,), loss=lm_loss, loss_inputs=(targets,), source=source,
        input_names=["tokens", "targets"], **trace_kwargs,  # type: ignore[arg-type]
    )


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of a model by its global name (tied ones once)."""
    out = dict(model.named_parameters())
    for name, b in model.named_buffers():
        out.setdefault(name, b)
    return {k: v.detach() for k, v in out.items()}


def root_source(root: nn.Module) -> registry.SourceProvider:
    """Modules of ``submodule`` nodes taken from a live model (same process)."""
    return root.get_submodule


def spec_source(spec: str, vocab_size: int) -> registry.SourceProvider:
    """Modules of ``submodule`` nodes rebuilt from the model spec, on meta (a worker's path)."""
    return _meta_provider(spec, lambda: build_model(spec, vocab_size, device="meta"))


def _meta_provider(spec: str, build: Callable[[], nn.Module]) -> registry.SourceProvider:
    """Submodules of the model ``build`` makes (once, on first use); ``spec``'s module may be imported."""
    module_name = spec.partition(":")[0]
    if ":" in spec and module_name:
        registry.allow_import(module_name)
    meta_model = functools.cache(build)
    provider: Callable[[str], nn.Module] = lambda path: meta_model().get_submodule(path)  # noqa: E731
    return provider


def graph_source(graph: OpGraph) -> registry.SourceProvider | None:
    src = graph.meta.get("source")
    if not src:
        return None
    if "task" in src:
        return task_source(str(src["task"]), dict(src.get("options") or {}))
    return spec_source(str(src["model"]), int(src["vocab_size"]))


def task_source(spec: str, options: dict) -> registry.SourceProvider:
    """Modules of ``submodule`` nodes rebuilt from a task's model, on meta (a worker's path)."""
    from fusionllm.models.task import build_task_model, load_task

    return _meta_provider(spec, lambda: build_task_model(load_task(spec, options), 0, device="meta"))


def trace_task(task: Task, model: torch.nn.Module, micro_batch_size: int, *, source: dict | None = None) -> OpGraph:
    """The task's model and loss traced on the first ``micro_batch_size`` rows of training batch 0.
    Tracing runs the model once: buffers a forward updates (BatchNorm's running statistics) are put back."""
    arrays = task.batch(0)
    if arrays[0].shape[0] < micro_batch_size:
        raise ConfigError(f"the task's batches hold {arrays[0].shape[0]} rows, fewer than a micro-batch of {micro_batch_size}")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))  # meta for planning: shapes only
    tensors = [torch.from_numpy(np.ascontiguousarray(a[:micro_batch_size])).to(device) for a in arrays]
    saved = {k: b.detach().clone() for k, b in model.named_buffers()}
    try:
        return trace(model, tensors[: task.inputs], loss=task.loss, loss_inputs=tensors[task.inputs :],
                     input_names=task.array_names(len(arrays)), source=source)
    finally:
        with torch.no_grad():
            for k, b in model.named_buffers():
                b.copy_(saved[k])
