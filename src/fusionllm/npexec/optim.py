"""AdamW in NumPy, step for step what ``runtime.optim.make_adamw`` gives with torch.

The update is torch.optim.AdamW's (decoupled weight decay, bias-corrected moments, ``eps`` added
after the square root), with its float32 operation order, so a NumPy stage and a torch stage stay
equal to about 1e-6 relative over many steps. Weight decay applies to matrices only (>= 2 axes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np


class NumpyAdamW:
    """AdamW over named float32 arrays, updated in place (the executor's ``trainable()``)."""

    def __init__(
        self,
        params: Mapping[str, np.ndarray],
        lr: float,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
    ) -> None:
        self.params = dict(params)
        self.lr = lr
        self.betas = betas
        self.eps = eps
        self.decay = {k: (weight_decay if p.ndim >= 2 else 0.0) for k, p in self.params.items()}
        self.steps: dict[str, int] = {}
        self.exp_avg: dict[str, np.ndarray] = {}
        self.exp_avg_sq: dict[str, np.ndarray] = {}

    def step(self, grads: Mapping[str, np.ndarray | None], lr: float | None = None) -> None:
        """One update; parameters without a gradient (None or absent) are left alone, as in torch."""
        if lr is not None:
            self.lr = lr
        beta1, beta2 = self.betas
        for name, p in self.params.items():
            g = grads.get(name)
            if g is None:
                continue
            g = np.asarray(g, dtype=np.float32)
            if name not in self.steps:
                self.steps[name] = 0
                self.exp_avg[name] = np.zeros_like(p)
                self.exp_avg_sq[name] = np.zeros_like(p)
            self.steps[name] += 1
            t = self.steps[name]
            m, v = self.exp_avg[name], self.exp_avg_sq[name]
            if self.decay[name]:
                p *= np.float32(1.0 - self.lr * self.decay[name])
            m += np.float32(1.0 - beta1) * (g - m)  # torch's lerp(m, g, 1 - beta1)
            v *= np.float32(beta2)
            v += np.float32(1.0 - beta2) * (g * g)
            step_size = self.lr / (1.0 - beta1**t)
            denom = np.sqrt(v) / np.float32(math.sqrt(1.0 - beta2**t)) + np.float32(self.eps)
            p += np.float32(-step_size) * (m / denom)

    def state_tensors(self) -> dict[str, np.ndarray]:
        """Moments and step counts in the checkpoint layout of ``StageRuntime.state_tensors``."""
        out: dict[str, np.ndarray] = {}
        for name, t in self.steps.items():
            out[f"adam/exp_avg/{name}"] = self.exp_avg[name].copy()
            out[f"adam/exp_avg_sq/{name}"] = self.exp_avg_sq[name].copy()
            out[f"adam/step/{name}"] = np.array([t], dtype=np.float32)
        return out

    def load_state(self, tensors: Mapping[str, np.ndarray]) -> None:
        """Take moments and step counts back from ``state_tensors`` (or a torch stage's checkpoint)."""
        for name, p in self.params.items():
            if f"adam/exp_avg/{name}" in tensors:
                self.steps[name] = int(np.asarray(tensors[f"adam/step/{name}"]).reshape(()))
                self.exp_avg[name] = np.array(tensors[f"adam/exp_avg/{name}"], dtype=p.dtype).reshape(p.shape)
                self.exp_avg_sq[name] = np.array(tensors[f"adam/exp_avg_sq/{name}"], dtype=p.dtype).reshape(p.shape)


def make_adamw(params: Mapping[str, np.ndarray], lr: float, weight_decay: float = 0.1) -> NumpyAdamW:
    """The NumPy twin of ``runtime.optim.make_adamw`` (same betas, eps and decay groups)."""
    return NumpyAdamW(params, lr, weight_decay=weight_decay)
