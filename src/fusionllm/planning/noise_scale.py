"""The gradient noise scale, measured while training (McCandlish et al., arXiv 1812.06162).

The simple noise scale B = tr(S) / |G|^2 (S: the per-row covariance of the gradient, G: the true
gradient) says what a larger batch buys: far below B, doubling the batch (or the groups, which
train like one run with their summed batch) halves the steps to a loss at little cost in tokens;
above it, it only spends tokens.

How it is measured, at no extra communication: every stage accumulates its gradients over the M
micro-batches of a step, and after the k-th micro-batch's backward it takes the squared norm of
what it has so far (``StageRuntime``: its own weights, those shared with other workers left out);
the coordinator sums the stages' norms per k. With G_k the sum of k micro-batch mean gradients
(b rows each), E|G_k|^2 = k^2 |G|^2 + k tr(S) / b, so a least-squares fit u_k = A k^2 + C k over
k = 1..M gives |G|^2 (A) and tr(S) / b (C) up to the same scale, and B = b C / A rows. One step's fit
is noisy: A and C are averaged over steps (an exponential average, bias-corrected) before the ratio,
as the paper recommends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DECAY = 0.95  # the exponential average's weight on the past: about the last 20 steps


def fit_accumulation(u: Sequence[float]) -> tuple[float, float] | None:
    """(A, C) of the least-squares fit u_k = A k^2 + C k, k = 1..len(u); None for fewer than 2 points
    or a non-finite norm."""
    n = len(u)
    if n < 2 or any(not (x == x and abs(x) != float("inf")) for x in u):
        return None
    ks = range(1, n + 1)
    s4 = sum(k**4 for k in ks)
    s3 = sum(k**3 for k in ks)
    s2 = sum(k**2 for k in ks)
    y2 = sum(x * k * k for x, k in zip(u, ks, strict=True))
    y1 = sum(x * k for x, k in zip(u, ks, strict=True))
    det = s4 * s2 - s3 * s3
    return (y2 * s2 - y1 * s3) / det, (s4 * y1 - s3 * y2) / det


@dataclass
class NoiseScale:
    """The running estimate of one run (or group): ``update`` with each step's accumulated norms."""

    decay: float = DECAY
    a: float = 0.0
    c: float = 0.0
    weight: float = 0.0  # the bias correction: 1 - decay^steps

    def update(self, u: Sequence[float], rows_per_micro_batch: int) -> float | None:
        """Take one step's u_k; the noise scale in rows so far (None until the averaged |G|^2 is positive)."""
        fit = fit_accumulation(u)
        if fit is not None:
            self.a = self.decay * self.a + (1 - self.decay) * fit[0]
            self.c = self.decay * self.c + (1 - self.decay) * fit[1]
            self.weight = self.decay * self.weight + (1 - self.decay)
        return self.rows(rows_per_micro_batch)

    def rows(self, rows_per_micro_batch: int) -> float | None:
        if self.weight == 0.0 or self.a <= 0.0 or self.c < 0.0:
            return None
        return rows_per_micro_batch * self.c / self.a
