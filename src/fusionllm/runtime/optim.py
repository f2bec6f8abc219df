"""Optimizer and learning-rate schedule shared by every trainer (reference and distributed)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn


def lr_at(step: int, *, lr: float, steps: int, warmup: int, min_ratio: float = 0.1) -> float:
    """Linear warmup for `warmup` steps, then cosine decay to `min_ratio * lr` at `steps`."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def make_adamw(named: Iterable[tuple[str, nn.Parameter]], lr: float, weight_decay: float = 0.1) -> torch.optim.AdamW:
    """AdamW with decay on matrices only (not on biases, norms or 1-d parameters)."""
    decay, no_decay = [], []
    for _, p in named:
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)
