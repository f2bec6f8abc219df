"""A training run's settings and result, and its learning-rate schedule: plain values every layer shares."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from fusionllm.core.errors import ConfigError
from fusionllm.core.options import PRECISIONS, Precision, TrainOptions

_T = TrainOptions()  # the declaration's defaults (core/options.py): an option's default, help and values are set there, once


@dataclass(frozen=True)
class TrainConfig:
    """What a run trains and how, as every layer reads it: each field an option names has that option's
    name and default (``launch/config.train_config`` builds it from the options); ``weight_decay``
    and ``grad_clip`` are no option."""

    model: str = _T.model
    steps: int = _T.steps
    batch_size: int = _T.batch_size
    seq_len: int = _T.seq_len
    lr: float = _T.lr
    seed: int = _T.seed
    data: str | None = _T.data
    metrics: str | None = None  # the option's path, as a string
    warmup: int = _T.warmup
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = _T.eval_every
    eval_batches: int = _T.eval_batches
    threads: int | None = _T.threads
    task: str = _T.task  # lm, vision or package.module:factory (models/task.py)
    image_size: int = _T.image_size
    tokenizer: str | None = _T.tokenizer  # bytes (None), a tokenizer.json or a directory with one (data/bpe.py)
    init_from: str | None = _T.init_from  # a Hugging Face checkpoint directory the LM starts from (models/hf.py)
    precision: Precision = _T.precision
    recompute: bool = _T.recompute
    log_to: str | None = _T.log_to  # core/tensorboard.py

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ConfigError(f"--lr must be > 0, got {self.lr}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision {self.precision!r}: choose {' or '.join(PRECISIONS)}")
        if self.warmup < 0 or self.eval_every < 0 or self.grad_clip < 0:
            raise ConfigError("--warmup, --eval-every and --grad-clip must be >= 0")
        if self.log_to is not None:
            from fusionllm.core.tensorboard import parse_log_to

            parse_log_to(self.log_to, self.metrics)  # a bad --log-to fails here, before anything starts


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    val_metrics: list[tuple[int, float]] = field(default_factory=list)  # a task's metric (accuracy) at each evaluation
    tokens: int = 0
    elapsed_s: float = 0.0
    num_params: int = 0
    model: Any = field(default=None, repr=False)  # a single-process run's trained module (for a caller that compares it)


def lr_at(step: float, *, lr: float, steps: int, warmup: int, min_ratio: float = 0.1) -> float:
    """Linear warmup for `warmup` steps, then cosine decay to `min_ratio * lr` at `steps`. ``step`` may be
    fractional: ``lr_at_tokens`` reads the schedule at a token count that is no whole step."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def lr_at_tokens(tokens: float, *, tokens_per_step: int, lr: float, steps: int, warmup: int, min_ratio: float = 0.1) -> float:
    """The schedule as a function of the tokens the run has trained on before a step (every group's, for
    several groups): ``lr_at`` at ``tokens / tokens_per_step`` steps of the run's global batch.

    Every trainer reads ``lr_at`` at its step (a group: at the user's step its inner step stands for,
    ``control/rounds.py``), so runs that train the same global batch per step, however they split it,
    follow the same schedule in tokens; ``benchmarks/time_to_target.py`` checks that on every run's
    step records (``lr`` against this at their ``tokens``)."""
    if tokens_per_step < 1:
        raise ValueError(f"tokens_per_step must be >= 1, got {tokens_per_step}")
    return lr_at(tokens / tokens_per_step, lr=lr, steps=steps, warmup=warmup, min_ratio=min_ratio)
