"""The language-modelling loss, shared by the reference trainer and the traced OpGraph."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def lm_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits (B, T, V), or of an object's ``.logits``."""
    logits = getattr(output, "logits", output)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
