"""A task: what a user brings to train (the model, its data, its loss), and how tasks are found.

A task is a ``Task``: the model (built by a function, so every process builds the same one from
the seed), training and validation batches (batch ``i`` a deterministic function of ``i``: every
worker computes the batches its stage reads itself), the loss and an optional metric, and the
optimiser settings it wants. A batch is a tuple of NumPy arrays: first the model's inputs, then the
loss's targets (``inputs`` says how many are inputs). The model is traced with the first rows of
training batch 0, so it may take one or several tensors; the loss is ``loss(output, *targets)``.

``--task`` names one: ``lm`` (the default: the language models of ``--model`` on byte-level text),
``vision`` (the ResNet family of ``--model`` on images of ``--data``), or ``package.module:factory``,
a function that returns a ``Task``. The factory is called with the run's options it names among
``model, data, seed, batch_size, seq_len, image_size`` (keyword arguments), on the coordinator and
on every worker, so it must be importable there and give the same batches everywhere.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
from typing import Any

import numpy as np
import torch
from torch import nn

from fusionllm.core.config import TrainConfig
from fusionllm.core.errors import RegistryError
from fusionllm.models.task_record import OPTIONS, Task


def batch_digest(task: Task, batches: int = 2) -> str:
    """A digest of the task's first batches (training and validation), when the task gives none."""
    h = hashlib.sha256()
    for a in (*task.batch(0), *(task.batch(1) if batches > 1 else ()), *task.val(0)):
        h.update(str((a.dtype.str, a.shape)).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def load_task(spec: str, options: dict[str, Any]) -> Task:
    """The task ``spec`` names, made with the run's ``options`` (see the module docstring)."""
    if spec == "vision":
        from fusionllm.models.vision_task import vision_task

        return vision_task(**{k: options[k] for k in ("model", "data", "seed", "batch_size", "image_size") if k in options})
    if ":" not in spec:
        raise RegistryError(f"unknown task {spec!r}: use lm, vision or 'package.module:factory' (a function returning a fusionllm.Task)")
    from fusionllm.models.spec import resolve_factory

    factory = resolve_factory(spec)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    task = factory(**{k: v for k, v in options.items() if k in OPTIONS and (takes_all or k in params)})
    if not isinstance(task, Task):
        raise RegistryError(f"task factory {spec!r} returned a {type(task).__name__}, not a fusionllm.Task")
    return task


def model_label(task: Task) -> str:
    """What a run summary calls the task's model: its class or factory's name."""
    made = task.model
    return getattr(made, "__qualname__", None) or getattr(made, "__name__", None) or type(made).__name__


def run_model_label(task_spec: str, model: str, init_from: str | None, options: dict) -> str:
    """The model a run trains, for its summary: ``--model`` (or ``--init-from``) for the built-in
    tasks, the task's own model for ``package.module:factory``."""
    if task_spec in ("lm", "vision"):
        return init_from or model
    return model_label(load_task(task_spec, options))


def build_task_model(task: Task, seed: int, device: str | torch.device | None = None) -> nn.Module:
    """The task's model with the run's seed (``device="meta"``: shapes only, nothing allocated)."""
    torch.manual_seed(seed)
    if device is not None:
        with torch.device(device):
            model = task.model()
    else:
        model = task.model()
    if not isinstance(model, nn.Module):
        raise RegistryError(f"the task's model function returned a {type(model).__name__}, not an nn.Module")
    return model


def parse_options(options: dict[str, str]) -> dict[str, Any]:
    """Task options as they travel (strings) back to their types."""
    out: dict[str, Any] = {}
    for k, v in options.items():
        if k not in OPTIONS:
            continue
        out[k] = int(v) if k in ("seed", "batch_size", "seq_len", "image_size") else v
    return out


def task_options(train: TrainConfig, batch_size: int | None = None) -> dict[str, object]:
    """The run's options a task factory may take (``models/task.py``)."""
    return {"model": train.model, "data": train.data, "seed": train.seed, "batch_size": batch_size or train.batch_size,
            "seq_len": train.seq_len, "image_size": train.image_size}


def task_settings(train: TrainConfig, task: Task) -> TrainConfig:
    """``train`` with the optimiser settings ``task`` sets."""
    given = {k: v for k, v in (("lr", task.lr), ("warmup", task.warmup), ("weight_decay", task.weight_decay)) if v is not None}
    return dataclasses.replace(train, **given) if given else train
