"""Hierarchical training of several groups in one plain PyTorch process: the reference, and the sweeps.

What a hierarchical run computes (``control/hierarchical.py``, ``runtime/stage/outer.py``), for groups of
equal speed with one fragment and blocking syncs, without a network: ``groups`` copies of the
model, each with its own AdamW, each training ``inner_steps`` steps of a round on its own batches
(group ``g`` reads batch ``i * groups + g`` of its ``group_batch`` rows), then one outer step on the
shared outer weights: the token-weighted mean of the groups' pseudo-gradients (``start - weights``,
encoded with the outer codec and error feedback), as Nesterov SGD (``nesterov_step``); every group
then goes on from the new outer weights, its AdamW state kept. ``warm_steps``: the run's first steps
as one group of ``batch_size`` rows (``--regroup K:GROUPS``), whose weights and AdamW state every
group starts from. The learning-rate schedule is the run's, over each group's own steps.

A test holds it equal to the distributed run (``tests/test_single_groups.py``); the per-token
efficiency sweeps (``experiments/hier_efficiency.py``) run it, since what a group learns per token
does not depend on the links that carry its traffic.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fusionllm.compress.codecs import CodecSpec, decode, encode, parse_codec
from fusionllm.compress.feedback import ErrorFeedback
from fusionllm.core.config import TrainConfig, TrainResult, lr_at
from fusionllm.core.errors import ConfigError
from fusionllm.data import Batcher
from fusionllm.data.lm_tokens import load_lm_tokens
from fusionllm.models.loss import lm_loss
from fusionllm.models.spec import build_lm, lm_tokenizer
from fusionllm.runtime.reference.single import autocast, clip_grad_norm, evaluate
from fusionllm.runtime.stage.optim import make_adamw
from fusionllm.runtime.stage.outer import nesterov_step
from fusionllm.schedule.hierarchy import group_rows

StepCallback = Callable[[dict], None]


@dataclass(frozen=True)
class Outer:
    """The outer loop of a run of ``groups`` groups (``groups`` 1 with ``inner_steps`` 1, momentum 0
    and lr 1 is synchronous training)."""

    groups: int
    inner_steps: int
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    codec: str = "none"
    group_batch: int | None = None  # rows per inner step of each group (default: the run's batch size shared by the groups)
    warm_steps: int = 0  # the first steps as one group of batch_size rows

    def check(self, config: TrainConfig) -> None:
        if self.groups < 1 or self.inner_steps < 1:
            raise ConfigError(f"groups {self.groups} and inner steps {self.inner_steps} must be at least 1")
        if not 0 <= self.warm_steps < config.steps:
            raise ConfigError(f"warm steps {self.warm_steps} must be below the run's {config.steps} steps")


class _Group:
    def __init__(self, model: torch.nn.Module, config: TrainConfig) -> None:
        self.model = model
        self.optimizer = make_adamw(model.named_parameters(), config.lr, config.weight_decay)

    def step(self, x: torch.Tensor, y: torch.Tensor, lr: float, config: TrainConfig) -> tuple[float, float]:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with autocast(config):
            logits = self.model(x)
        loss = lm_loss(logits.float(), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = clip_grad_norm(self.model, config.grad_clip)
        self.optimizer.step()
        return float(loss.item()), norm

    def weights(self) -> dict[str, np.ndarray]:
        return {n: p.detach().numpy().astype(np.float32, copy=True) for n, p in self.model.named_parameters() if p.requires_grad}

    def set_weights(self, new: dict[str, np.ndarray]) -> None:
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                if n in new:
                    p.copy_(torch.from_numpy(new[n]))


def train_groups_single(config: TrainConfig, outer: Outer, on_step: StepCallback = lambda _: None,
                        on_eval: StepCallback = lambda _: None) -> TrainResult:
    """Train ``config.model`` as ``outer.groups`` groups in this process (see the module). One record
    per inner step of each group (``group``, ``inner_step``, ``round``, ``loss``, ``tokens`` so far);
    evaluations (every ``eval_every`` steps of the run's schedule, of the outer weights after the
    rounds that cover them, and at the end) go to ``on_eval`` and the result's ``val_losses``."""
    outer.check(config)
    if config.task != "lm":
        raise ConfigError("single-process groups train language models only (--task lm)")
    if config.threads:
        torch.set_num_threads(config.threads)
    tokens = load_lm_tokens(config.data, lm_tokenizer(config.tokenizer, config.init_from), 0.1)
    batch = outer.group_batch or group_rows(config.batch_size, outer.groups)
    warm_batches = Batcher(tokens.train, config.batch_size, config.seq_len, config.seed)
    group_batches = Batcher(tokens.train, batch, config.seq_len, config.seed)
    val = Batcher(tokens.val, config.batch_size, config.seq_len, config.seed)
    model = build_lm(config.model, tokens.vocab_size, seed=config.seed, init_from=config.init_from)
    result = TrainResult(num_params=sum(p.numel() for p in model.parameters()))
    started = time.perf_counter()

    def log_eval(step: int, m: torch.nn.Module) -> None:
        loss = evaluate(m, val, config.eval_batches)
        result.val_losses.append((step, loss))
        on_eval({"step": step, "val_loss": loss, "tokens": result.tokens, "elapsed_s": round(time.perf_counter() - started, 4)})

    first = _Group(model, config)
    for step in range(outer.warm_steps):  # one group of batch_size rows (``--regroup K:...`` starts here)
        lr = lr_at(step, lr=config.lr, steps=config.steps, warmup=config.warmup)
        x, y = map(torch.from_numpy, warm_batches.arrays(step))
        loss, norm = first.step(x, y, lr, config)
        result.tokens += x.numel()
        result.losses.append(loss)
        on_step({"step": step, "loss": loss, "lr": lr, "grad_norm": norm, "tokens": result.tokens})
        if config.eval_every and (step + 1) % config.eval_every == 0:
            log_eval(step + 1, first.model)
    groups = [first] + [_clone(first, config) for _ in range(outer.groups - 1)]
    anchor = first.weights()
    momentum: dict[str, np.ndarray] = {}
    feedback = [ErrorFeedback() for _ in groups]
    codec = parse_codec(outer.codec)
    span = config.steps - outer.warm_steps
    rounds = math.ceil(span / outer.inner_steps)
    total = rounds * outer.inner_steps
    data_from = outer.warm_steps  # the first batch index no earlier grouping read (Phases: data_from)
    i = 0
    for k in range(rounds):
        for g, grp in enumerate(groups):
            for j in range(outer.inner_steps):
                at = i + j
                lr = lr_at(min(config.steps - 1, outer.warm_steps + at * span // total), lr=config.lr, steps=config.steps, warmup=config.warmup)
                x, y = map(torch.from_numpy, group_batches.arrays(data_from + at * outer.groups + g))
                loss, norm = grp.step(x, y, lr, config)
                result.tokens += x.numel()
                result.losses.append(loss)
                on_step({"group": g, "inner_step": outer.warm_steps + at, "round": k, "loss": loss, "lr": lr, "grad_norm": norm,
                         "tokens": result.tokens})
        i += outer.inner_steps
        deltas = []
        for g, grp in enumerate(groups):
            now = grp.weights()
            deltas.append({n: _roundtrip(feedback[g], n, anchor[n] - now[n], codec) for n in anchor})
        mean = {n: sum(d[n] for d in deltas) / len(deltas) for n in anchor}  # equal tokens per group: equal weights
        for n in anchor:
            anchor[n], momentum[n] = nesterov_step(anchor[n], momentum.get(n), mean[n], outer.outer_lr, outer.outer_momentum)
        for grp in groups:
            grp.set_weights(anchor)
        done = outer.warm_steps + i * span // total
        before = outer.warm_steps + (i - outer.inner_steps) * span // total
        if config.eval_every and (done // config.eval_every > before // config.eval_every or k + 1 == rounds):
            log_eval(min(done, config.steps), first.model)
    result.elapsed_s = time.perf_counter() - started
    result.model = first.model
    return result


def _clone(group: _Group, config: TrainConfig) -> _Group:
    """Another group with the same weights and AdamW state (a regroup from one group)."""
    other = _Group(copy.deepcopy(group.model), config)
    other.optimizer.load_state_dict(copy.deepcopy(group.optimizer.state_dict()))
    return other


def _roundtrip(feedback: ErrorFeedback, name: str, delta: np.ndarray, codec: CodecSpec) -> np.ndarray:
    """What the other groups decode of this delta (``OuterState._encode``): its own sent copy."""
    if codec.lossless:
        return delta

    def roundtrip(total: np.ndarray) -> np.ndarray:
        kind, data = encode(total, codec)
        return decode(kind, data, total.shape)

    return feedback.apply(name, delta, roundtrip)
