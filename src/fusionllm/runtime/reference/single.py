"""`fusionllm train --single-process`: plain PyTorch training, the reference for every distributed run."""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fusionllm.core.config import TrainConfig, TrainResult, lr_at
from fusionllm.core.errors import ConfigError
from fusionllm.core.tensorboard import MetricsWriter
from fusionllm.data import Batcher
from fusionllm.data.lm_tokens import load_lm_tokens
from fusionllm.models.loss import lm_loss
from fusionllm.models.spec import build_lm, context_length, lm_tokenizer
from fusionllm.runtime.backends.model_graph import trace_lm, trace_task
from fusionllm.runtime.backends.torch_backend import square_sum
from fusionllm.runtime.reference.masks import split_masks
from fusionllm.runtime.stage.global_norm import total_sq
from fusionllm.runtime.stage.optim import make_adamw

if TYPE_CHECKING:
    from fusionllm.models.task import Task

StepCallback = Callable[[dict], None]


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Clip by the global gradient norm as the pipeline does (``runtime/stage/global_norm.py``): each
    gradient's squared norm (``torch_backend.square_sum``), those added up exactly (``math.fsum``, whatever the
    order or the split), the coefficient ``min(1, max_norm / (norm + 1e-6))``; returns the norm. Not
    ``torch.nn.utils.clip_grad_norm_``: its float32 norm of per-tensor norms rounds differently, and
    AdamW's first steps turn a 1e-7 change of the coefficient into 1e-3 of the loss within a few steps
    (measured on ResNet-18: bitwise equal losses without clipping, 2.9e-5 apart at step 3 with it)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = math.sqrt(total_sq(square_sum(g) for g in grads))
    if max_norm > 0:
        coef = min(1.0, max_norm / (total + 1e-6))
        for g in grads:
            g.mul_(coef)
    return total


@contextlib.contextmanager
def per_use_gradients(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, a weight that several modules share (a language model's tied embedding and
    head) takes each use's gradient apart, summed over the micro-batches; on leaving, the uses' sums
    are added in the order of the modules (as a pipeline does: the stages that hold the uses each
    accumulate their own, and the step's reduce adds them). Autograd alone adds the uses within each
    micro-batch, which rounds differently: 1 of gpt-micro's 52 gradients differed in the last bits
    after 4 micro-batches, and AdamW carries that into every weight within a few steps. A split that
    keeps two uses on one stage adds them per micro-batch, as autograd does."""
    uses: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    params: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.requires_grad:
                uses.setdefault(id(p), []).append((module, name))
                params[id(p)] = p
    shared = {k: v for k, v in uses.items() if len(v) > 1}
    copies: dict[int, list[torch.nn.Parameter]] = {}
    for k, registered in shared.items():
        copies[k] = [torch.nn.Parameter(params[k].detach()) for _ in registered]  # the same storage, a gradient each
        for (module, name), copy_ in zip(registered, copies[k], strict=True):
            module._parameters[name] = copy_
    try:
        yield
    finally:
        for k, registered in shared.items():
            for module, name in registered:
                module._parameters[name] = params[k]
            grads = [c.grad for c in copies[k] if c.grad is not None]
            if grads:
                total = grads[0]
                for g in grads[1:]:
                    total = total + g
                p = params[k]
                p.grad = total if p.grad is None else p.grad + total


def mean_loss(parts: list[float]) -> float:
    """A step's loss from its micro-batches' losses as the coordinator takes it (``control/steps.py``):
    their float64 sum in micro-batch order over their count."""
    return sum(parts) / len(parts)


def autocast(config: TrainConfig) -> torch.autocast:
    """``--precision bf16``: the forward under CPU/CUDA autocast (weights and AdamW state stay fp32)."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.precision == "bf16")


def seeded_masks(model: torch.nn.Module, trace: Callable[[], Any], seed: int) -> Callable[[int, int], Any]:
    """``masks(step, micro_batch)``: a block in which the model's forward draws the masks the split
    draws (``masks.split_masks``); a model with no random op is not traced and gets no hooks."""
    from fusionllm.runtime.stage.executor import RANDOM_MODULES

    if not any(isinstance(m, RANDOM_MODULES) for m in model.modules()) and not _user_forward(model):
        return lambda step, mb: contextlib.nullcontext()
    graph = trace()
    return lambda step, mb: split_masks(model, graph, seed, step, mb)


def _user_forward(model: torch.nn.Module) -> bool:
    """Whether a module outside torch.nn (its forward may call a random function) is in the model."""
    return any(not type(m).__module__.startswith("torch.nn.modules") for m in model.modules())


def lm_setup(config: TrainConfig) -> tuple[Batcher, Batcher, Any]:
    """The language-model task as one process trains it: train and validation batches, and the model
    (checked against ``--seq-len``)."""
    tokens = load_lm_tokens(config.data, lm_tokenizer(config.tokenizer, config.init_from), 0.1)
    train_batches = Batcher(tokens.train, config.batch_size, config.seq_len, config.seed)
    val_batches = Batcher(tokens.val, config.batch_size, config.seq_len, config.seed)
    model = build_lm(config.model, tokens.vocab_size, seed=config.seed, init_from=config.init_from)
    block = context_length(model)
    if isinstance(block, int) and config.seq_len > block:
        raise ConfigError(f"--seq-len {config.seq_len} exceeds the model's block size {block}; use --seq-len {block} or less")
    return train_batches, val_batches, model


def train_single(config: TrainConfig, on_step: StepCallback = lambda _: None, *, micro_batches: int = 1,
                 skip: frozenset[int] = frozenset(), task: Task | None = None) -> TrainResult:
    """Train `config.model` (or `config.task`'s model) in this process; one metrics record per optimizer step.
    ``skip``: steps not taken (their batches unused), as a distributed run skips steps its numeric guards refused.
    ``task``: a ``fusionllm.Task`` object to train instead of the one ``config.task`` names."""
    if config.threads:
        torch.set_num_threads(config.threads)
    if config.task != "lm" or task is not None:
        return train_single_task(config, on_step, micro_batches=micro_batches, skip=skip, task=task)
    train_batches, val_batches, model = lm_setup(config)
    if config.batch_size % micro_batches:
        raise ConfigError(f"--batch-size {config.batch_size} does not split into {micro_batches} micro-batches")
    masks = seeded_masks(model, lambda: trace_lm(copy.deepcopy(model), config.batch_size // micro_batches, config.seq_len, spec=config.model),
                         config.seed)
    optimizer = make_adamw(model.named_parameters(), config.lr, config.weight_decay)
    result = TrainResult(num_params=sum(p.numel() for p in model.parameters()))
    started = time.perf_counter()
    with MetricsWriter(config.metrics, config.log_to) as metrics:
        for step in range(config.steps):
            if step in skip:
                continue
            model.train()
            lr = lr_at(step, lr=config.lr, steps=config.steps, warmup=config.warmup)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = train_batches.get(step)
            optimizer.zero_grad(set_to_none=True)
            size = x.shape[0] // micro_batches
            parts = []
            with per_use_gradients(model):
                for mb in range(micro_batches):  # the micro-batches a pipeline runs, each with its own masks
                    with autocast(config), masks(step, mb):
                        logits = model(x[mb * size : (mb + 1) * size])
                    part = lm_loss(logits.float(), y[mb * size : (mb + 1) * size])
                    (part / micro_batches if micro_batches > 1 else part).backward()
                    parts.append(float(part.detach()))
            grad_norm = clip_grad_norm(model, config.grad_clip)
            optimizer.step()
            result.tokens += x.numel()
            result.losses.append(mean_loss(parts))
            elapsed = time.perf_counter() - started
            record = {
                "step": step, "loss": result.losses[-1], "tokens": result.tokens, "elapsed_s": round(elapsed, 4),
                "lr": lr, "grad_norm": grad_norm, "tokens_per_s": round(result.tokens / max(elapsed, 1e-9), 1),
            }
            last = step == config.steps - 1
            if config.eval_every and ((step + 1) % config.eval_every == 0 or last):
                paused = time.perf_counter()
                record["val_loss"] = evaluate(model, val_batches, config.eval_batches)
                result.val_losses.append((step, record["val_loss"]))
                started += time.perf_counter() - paused  # elapsed_s counts training only, as a distributed run's
            metrics.write(record)
            on_step(record)
    result.elapsed_s = time.perf_counter() - started
    result.model = model
    return result


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Batcher, max_batches: int) -> float:
    """Mean loss over the whole validation batches (``Batcher.eval_starts``), as the pipeline
    computes it; over the one partial batch only when the split holds no whole batch."""
    model.eval()
    n = len(batches.eval_starts(max_batches))
    whole = [tuple(map(torch.from_numpy, batches.eval_arrays(i, max_batches))) for i in range(n)] or list(batches.iter_eval(max_batches))
    losses = [float(lm_loss(model(x), y)) for x, y in whole]
    model.train()
    return sum(losses) / len(losses)


def train_single_task(config: TrainConfig, on_step: StepCallback = lambda _: None, *, micro_batches: int = 1,
                      skip: frozenset[int] = frozenset(), task: Task | None = None) -> TrainResult:
    """A ``fusionllm.Task`` trained in this process. With ``micro_batches`` each batch is cut into
    that many equal micro-batches whose gradients add up (loss / micro_batches each), as a pipeline
    runs them: layers whose result depends on the micro-batch (BatchNorm) then see the same rows."""
    from fusionllm.models.task import build_task_model, load_task, task_options, task_settings

    task = task if task is not None else load_task(config.task, task_options(config))
    config = task_settings(config, task)
    model = build_task_model(task, config.seed)
    rows0 = task.batch(0)[0].shape[0]
    masks = seeded_masks(model, lambda: trace_task(task, model, max(1, rows0 // micro_batches)), config.seed)
    lr0, warmup = config.lr, config.warmup
    optimizer = make_adamw(model.named_parameters(), lr0, config.weight_decay)
    result = TrainResult(num_params=sum(p.numel() for p in model.parameters()))
    started = time.perf_counter()
    with MetricsWriter(config.metrics, config.log_to) as metrics:
        for step in range(config.steps):
            if step in skip:
                continue
            model.train()
            lr = lr_at(step, lr=lr0, steps=config.steps, warmup=warmup)
            for group in optimizer.param_groups:
                group["lr"] = lr
            arrays = [torch.from_numpy(np.ascontiguousarray(a)) for a in task.batch(step)]
            rows = arrays[0].shape[0]
            if rows % micro_batches:
                raise ConfigError(f"the task's batch of {rows} rows does not split into {micro_batches} micro-batches")
            size = rows // micro_batches
            optimizer.zero_grad(set_to_none=True)
            parts = []
            with per_use_gradients(model):
                for mb in range(micro_batches):
                    part = [a[mb * size : (mb + 1) * size] for a in arrays]
                    with autocast(config), masks(step, mb):
                        out = model(*part[: task.inputs])
                    loss = task.loss(out.float() if isinstance(out, torch.Tensor) else out, *part[task.inputs :])
                    (loss / micro_batches if micro_batches > 1 else loss).backward()
                    parts.append(float(loss.detach()))
            total = mean_loss(parts)
            grad_norm = clip_grad_norm(model, config.grad_clip)
            optimizer.step()
            result.tokens += rows * task.items_per_row
            result.losses.append(total)
            elapsed = time.perf_counter() - started
            record = {
                "step": step, "loss": total, "tokens": result.tokens, "elapsed_s": round(elapsed, 4),
                "lr": lr, "grad_norm": grad_norm, "tokens_per_s": round(result.tokens / max(elapsed, 1e-9), 1),
            }
            if config.eval_every and ((step + 1) % config.eval_every == 0 or step == config.steps - 1):
                paused = time.perf_counter()
                record["val_loss"], metric = evaluate_task(model, task, config.eval_batches)
                started += time.perf_counter() - paused  # elapsed_s counts training only, as a distributed run's
                if metric is not None:
                    record[f"val_{task.metric_name}"] = metric
                    result.val_metrics.append((step, metric))
                result.val_losses.append((step, record["val_loss"]))
            metrics.write(record)
            on_step(record)
    result.elapsed_s = time.perf_counter() - started
    result.model = model  # the trained module, for a caller that compares it
    return result


@torch.no_grad()
def evaluate_task(model: torch.nn.Module, task: Any, max_batches: int) -> tuple[float, float | None]:
    """Mean validation loss (and metric) over ``min(max_batches, task.val_batches)`` batches."""
    model.eval()
    losses, metrics = [], []
    for j in range(min(max_batches, task.val_batches)):
        arrays = [torch.from_numpy(np.ascontiguousarray(a)) for a in task.val(j)]
        out = model(*arrays[: task.inputs])
        losses.append(float(task.loss(out, *arrays[task.inputs :])))
        if task.metric is not None:
            metrics.append(float(task.metric(out, *arrays[task.inputs :])))
    model.train()
    return sum(losses) / max(len(losses), 1), (sum(metrics) / len(metrics) if metrics else None)
