"""Optimizer and learning-rate schedule shared by every trainer (reference and distributed)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from fusionllm.core.config import lr_at  # noqa: F401 (the schedule lives in core; re-exported)


def make_adamw(named: Iterable[tuple[str, nn.Parameter]], lr: float, weight_decay: float = 0.1) -> torch.optim.AdamW:
    """AdamW with decay on matrices only (not on biases, norms or 1-d parameters)."""
    decay, no_decay = [], []
    for _, p in named:
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)
