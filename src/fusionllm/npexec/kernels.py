"""Forward and backward of the layers of a GPT in float32 NumPy, as torch computes them.

Each ``*_forward`` returns its output and what its ``*_backward`` needs; each backward takes that
and the output's gradient and returns the gradients of the inputs and weights. Shapes follow
gpt.py: B batch, T sequence, C embedding width, H heads, D = C / H head width, V vocabulary.
"""

from __future__ import annotations

import math

import numpy as np

F32 = np.float32
_SQRT_HALF = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_ERFC_COEFFS = (
    -1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806,
    0.27886807, -1.13520398, 1.48851587, -0.82215223, 0.17087277,
)


def normal_cdf_pdf(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Phi(x) and phi(x) of the standard normal, in float32.

    Phi goes through erfc, with the Chebyshev fit of Numerical Recipes (``erfcc``, relative error
    < 1.2e-7 in exact arithmetic): relative to erfc itself, so ``x * Phi(x)`` keeps about 1e-5
    relative precision far into the negative tail (torch's float32 ``1 + erf`` cancels there),
    and its ``exp(-x^2 / 2)`` is phi's too.
    """
    z = np.abs(x)
    z *= F32(_SQRT_HALF)
    t = F32(0.5) * z
    t += F32(1.0)
    np.reciprocal(t, out=t)
    poly = np.full_like(z, F32(_ERFC_COEFFS[-1]))
    for c in _ERFC_COEFFS[-2::-1]:
        poly *= t
        poly += F32(c)
    np.exp(poly, out=poly)
    z *= z
    np.negative(z, out=z)
    gauss = np.exp(z, out=z)  # exp(-x^2 / 2)
    tail = poly
    tail *= t
    tail *= gauss
    tail *= F32(0.5)  # Phi(-|x|) = erfc(|x| / sqrt 2) / 2
    cdf = np.where(x >= 0, F32(1.0) - tail, tail)
    gauss *= F32(_INV_SQRT_2PI)
    return cdf, gauss


# ---- linear -----------------------------------------------------------------------------------
def linear_forward(x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    y = x @ w.T  # (..., out)
    return y + b if b is not None else y


def linear_backward(
    gy: np.ndarray, x: np.ndarray, w: np.ndarray, has_bias: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(dx, dw, db) of ``y = x @ w.T + b``."""
    g2 = gy.reshape(-1, gy.shape[-1])  # (N, out)
    dx = gy @ w  # (..., in)
    dw = g2.T @ x.reshape(-1, x.shape[-1])  # (out, in)
    db = g2.sum(axis=0) if has_bias else None
    return dx, dw, db


# ---- layer norm -------------------------------------------------------------------------------
def layer_norm_forward(
    x: np.ndarray, w: np.ndarray | None, b: np.ndarray | None, eps: float, ndim: int = 1
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """Normalise over the last ``ndim`` axes (biased variance, eps inside the root, like torch)."""
    axes = tuple(range(x.ndim - ndim, x.ndim))
    mu = x.mean(axis=axes, keepdims=True)
    xc = x - mu
    rstd = (1.0 / np.sqrt((xc * xc).mean(axis=axes, keepdims=True) + F32(eps))).astype(F32)
    xhat = xc * rstd
    y = xhat
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y, (xhat, rstd)


def layer_norm_backward(
    gy: np.ndarray, saved: tuple[np.ndarray, np.ndarray], w: np.ndarray | None, has_bias: bool, ndim: int = 1
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(dx, dw, db) of layer norm."""
    xhat, rstd = saved
    axes = tuple(range(gy.ndim - ndim, gy.ndim))
    lead = tuple(range(gy.ndim - ndim))
    dxhat = gy * w if w is not None else gy
    dx = rstd * (
        dxhat - dxhat.mean(axis=axes, keepdims=True) - xhat * (dxhat * xhat).mean(axis=axes, keepdims=True)
    )
    dw = (gy * xhat).sum(axis=lead) if w is not None else None
    db = gy.sum(axis=lead) if has_bias else None
    return dx, dw, db


# ---- GELU -------------------------------------------------------------------------------------
def gelu_forward(x: np.ndarray, approximate: str = "none") -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """``x * Phi(x)`` (exact, torch's default) or the tanh approximation; saves what backward needs."""
    if approximate == "tanh":
        inner = x * x
        inner *= F32(0.044715)
        inner += F32(1.0)
        inner *= x
        inner *= F32(_SQRT_2_OVER_PI)
        th = np.tanh(inner, out=inner)
        return F32(0.5) * x * (F32(1.0) + th), (x, th)
    cdf, pdf = normal_cdf_pdf(x)
    return x * cdf, (x, cdf, pdf)


def gelu_backward(gy: np.ndarray, saved: tuple[np.ndarray, ...], approximate: str = "none") -> np.ndarray:
    if approximate == "tanh":
        x, th = saved
        d = F32(1.0) - th * th
        d *= F32(_SQRT_2_OVER_PI) * (F32(1.0) + F32(3 * 0.044715) * x * x)
        d *= F32(0.5) * x
        d += F32(0.5) * (F32(1.0) + th)
        return gy * d
    x, cdf, pdf = saved
    d = x * pdf
    d += cdf
    return gy * d


# ---- attention --------------------------------------------------------------------------------
def attention_forward(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, *, causal: bool, scale: float | None = None
) -> tuple[np.ndarray, tuple[np.ndarray, float]]:
    """softmax(q k^T * scale [+ causal mask]) v over (..., T, D); the mask is top-left aligned."""
    s = F32(scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    scores = (q @ np.swapaxes(k, -1, -2)) * s  # (..., Tq, Tk)
    if causal:
        tq, tk = scores.shape[-2:]
        scores = np.where(np.tril(np.ones((tq, tk), dtype=bool)), scores, F32(-np.inf))
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return p @ v, (p, float(s))


def attention_backward(
    gy: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, saved: tuple[np.ndarray, float]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dq, dk, dv) of attention_forward."""
    p, s = saved
    dv = np.swapaxes(p, -1, -2) @ gy  # (..., Tk, D)
    dp = gy @ np.swapaxes(v, -1, -2)  # (..., Tq, Tk)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True)) * F32(s)
    return ds @ k, np.swapaxes(ds, -1, -2) @ q, dv


# ---- embedding --------------------------------------------------------------------------------
def embedding_forward(idx: np.ndarray, w: np.ndarray) -> np.ndarray:
    return w[idx]  # (*idx.shape, C)


def embedding_backward(gy: np.ndarray, idx: np.ndarray, num: int, padding_idx: int | None) -> np.ndarray:
    """The weight's gradient: rows summed per token id (the padding row gets none, as in torch)."""
    dw = np.zeros((num, gy.shape[-1]), dtype=F32)
    np.add.at(dw, idx.reshape(-1), gy.reshape(-1, gy.shape[-1]))
    if padding_idx is not None:
        dw[padding_idx] = 0.0
    return dw


# ---- cross-entropy ----------------------------------------------------------------------------
def cross_entropy_forward(
    logits: np.ndarray, targets: np.ndarray, *, ignore_index: int = -100, reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, float]]:
    """Cross-entropy of logits (N, V) against class ids (N,), as F.cross_entropy."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))  # (N, V)
    keep = targets != ignore_index
    safe = np.where(keep, targets, 0)
    nll = -np.take_along_axis(logp, safe[:, None], axis=1)[:, 0]
    if label_smoothing:
        nll = (1.0 - label_smoothing) * nll - label_smoothing * logp.mean(axis=-1)
    nll = np.where(keep, nll, F32(0.0)).astype(F32)
    if reduction == "none":
        return nll, (logp, keep, 1.0)
    denom = float(keep.sum()) if reduction == "mean" else 1.0
    return np.asarray(nll.sum(dtype=np.float32) / F32(denom), dtype=F32), (logp, keep, denom)


def cross_entropy_backward(
    gy: np.ndarray, targets: np.ndarray, saved: tuple[np.ndarray, np.ndarray, float], label_smoothing: float = 0.0
) -> np.ndarray:
    """d loss / d logits."""
    logp, keep, denom = saved
    g = np.exp(logp)  # softmax
    n, v = logp.shape
    rows = np.arange(n)
    safe = np.where(keep, targets, 0)
    g[rows, safe] -= F32(1.0 - label_smoothing)
    if label_smoothing:
        g -= F32(label_smoothing / v)
    scale = gy[:, None] if gy.ndim == 1 else gy / F32(denom)
    return (g * keep[:, None] * scale).astype(F32)
