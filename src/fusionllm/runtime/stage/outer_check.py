"""What a worker tells the coordinator about a round's pseudo-gradients before they are averaged,
and how it averages them (hierarchical mode, ``runtime/stage/outer.py``).

``report``: over the parameters it leads in its group (``Exchange.leads``: a group's leaders cover
each fragment once, so the coordinator sums a group's reports), the dot products of every sending
group's decoded delta with every other's and with the outer momentum, and whether each delta is
finite. The coordinator judges from those (``control/outer_checks.py``): norms, cosines, and the
direction of the others' sum all follow from the dot products. Sums are float64; a value that is
not finite counts as 0 in them (the flag says it was there).

``average``: the groups' deltas, token-weighted (``mean``; ``clipped`` is the mean with the
coordinator's per-group scales), or the coordinate-wise trimmed mean (``trimmed``, three groups or
more: each coordinate's highest and lowest value dropped, the rest averaged alike).
"""

from __future__ import annotations

import hashlib

import numpy as np

from fusionllm.core.errors import FusionError
from fusionllm.core.options import OUTER_AGGREGATES as AGGREGATES


def _clean(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    return x if np.isfinite(x).all() else np.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def digests(deltas: dict[int, dict[str, np.ndarray]], names: list[str]) -> dict[str, dict[str, str]]:
    """A short digest of each group's decoded delta per parameter: the groups that received one sender's
    delta compare them, so a sender that pushes different deltas to different groups is caught."""
    return {str(g): {n: hashlib.blake2b(np.ascontiguousarray(deltas[g][n], dtype=np.float32).tobytes(), digest_size=8).hexdigest()
                     for n in names} for g in sorted(deltas)}


def report(deltas: dict[int, dict[str, np.ndarray]], momentum: dict[str, np.ndarray],
           names: list[str]) -> tuple[dict[str, dict[str, float]], dict[str, bool], float]:
    """Per sending group (``deltas``: group -> parameter -> decoded delta) over ``names``: its dot
    products with every group's delta (``dots[g][h]``, ``h >= g``, ``g`` itself: the squared norm)
    and with the momentum (``dots[g]["m"]``), whether it is finite; and the momentum's squared norm."""
    groups = sorted(deltas)
    dots: dict[str, dict[str, float]] = {str(g): {} for g in groups}
    finite = {str(g): all(bool(np.isfinite(deltas[g][n]).all()) for n in names) for g in groups}
    momentum_sq = 0.0
    for n in names:
        vec = {g: _clean(deltas[g][n]) for g in groups}
        m = _clean(momentum[n]) if n in momentum else None
        if m is not None:
            momentum_sq += float(m @ m)
        for i, g in enumerate(groups):
            row = dots[str(g)]
            for h in groups[i:]:
                row[str(h)] = row.get(str(h), 0.0) + float(vec[g] @ vec[h])
            if m is not None:
                row["m"] = row.get("m", 0.0) + float(vec[g] @ m)
    return dots, finite, momentum_sq


def average(deltas: dict[int, dict[str, np.ndarray]], weights: dict[int, float], names: list[str], *,
            scale: dict[int, float] | None = None, aggregate: str = "mean") -> dict[str, np.ndarray]:
    """The outer step's gradient per parameter: ``deltas`` (group -> parameter -> delta) averaged
    with the token ``weights`` of their groups, each first multiplied by its ``scale`` (clipping)."""
    if aggregate not in AGGREGATES:
        raise FusionError(f"outer aggregate {aggregate!r}: choose one of {', '.join(AGGREGATES)}")
    groups = sorted(weights)
    total = float(sum(weights.values()))
    if total <= 0:
        raise FusionError(f"the groups' token weights add up to {total}")
    scale = scale or {}
    out: dict[str, np.ndarray] = {}
    for n in names:
        if aggregate == "trimmed" and len(groups) >= 3:
            stack = np.stack([deltas[g][n].astype(np.float32, copy=False) * np.float32(scale.get(g, 1.0)) for g in groups])
            stack.sort(axis=0)
            out[n] = stack[1:-1].mean(axis=0, dtype=np.float32)
            continue
        acc = np.zeros_like(deltas[groups[0]][n], dtype=np.float32)
        for g in groups:
            acc += np.float32(weights[g] / total * scale.get(g, 1.0)) * deltas[g][n].astype(np.float32, copy=False)
        out[n] = acc
    return out
