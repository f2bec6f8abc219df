"""A training run's settings and result, and its learning-rate schedule: plain values every layer shares."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from fusionllm.core.errors import ConfigError


@dataclass(frozen=True)
class TrainConfig:
    model: str = "gpt-micro"
    steps: int = 200
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    seed: int = 0
    data: str | None = None
    metrics: str | None = None
    warmup: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_batches: int = 4
    threads: int | None = None
    task: str = "lm"  # lm, vision or package.module:factory (models/task.py)
    image_size: int = 32  # --task vision: images are resized to this many pixels square
    tokenizer: str | None = None  # bytes (None), a tokenizer.json or a directory with one (data/bpe.py)
    init_from: str | None = None  # a Hugging Face checkpoint directory the LM starts from (models/hf.py)
    precision: str = "fp32"  # fp32, or bf16: autocast compute with fp32 master weights and AdamW state
    recompute: bool = False  # activation checkpointing per stage: module ops run again in the backward
    log_to: str | None = None  # tensorboard or tensorboard:DIR: the records as TensorBoard scalars too (core/tensorboard.py)

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


PRECISIONS = ("fp32", "bf16")


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    val_metrics: list[tuple[int, float]] = field(default_factory=list)  # a task's metric (accuracy) at each evaluation
    tokens: int = 0
    elapsed_s: float = 0.0
    num_params: int = 0
    model: Any = field(default=None, repr=False)  # a single-process run's trained module (for a caller that compares it)


def lr_at(step: int, *, lr: float, steps: int, warmup: int, min_ratio: float = 0.1) -> float:
    """Linear warmup for `warmup` steps, then cosine decay to `min_ratio * lr` at `steps`."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))
