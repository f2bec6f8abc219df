"""Fences: groups of devices whose mutual links are fast and alike, and their order in the pipeline.

Grouping is complete-linkage clustering on bandwidth: two groups merge while the slowest link
between them is at least a threshold, so every pair inside a fence is fast. The threshold sits in
the widest gap between the cluster's distinct link rates (a factor of at least ``min_gap``; without
such a gap all devices form one fence).
Ordering picks the sequence of fences whose slowest consecutive link is the fastest (then the
largest sum of log-rates): the tensors crossing fences then take the best links there are.
"""

from __future__ import annotations

import itertools
import math

from fusionllm.cluster.hardware import Hardware


def find_fences(hw: Hardware, *, min_gap: float = 2.0) -> list[list[int]]:
    import numpy as np

    n = len(hw)
    if n == 1:
        return [[0]]
    raw = np.array(hw.bandwidth, dtype=float)
    sym = np.minimum(raw, raw.T)
    rates = np.unique(sym[~np.eye(n, dtype=bool)])
    threshold = 0.0
    best_gap = min_gap
    for lo, hi in itertools.pairwise(rates.tolist()):
        if hi / lo >= best_gap:
            best_gap, threshold = hi / lo, hi
    # complete linkage: merge the two groups whose slowest mutual link is fastest, while it is fast
    bw = sym.copy()
    np.fill_diagonal(bw, -1.0)
    groups = [[i] for i in range(n)]
    while len(groups) > 1:
        flat = int(np.argmax(bw))
        a, b = divmod(flat, len(groups))
        if bw[a, b] < threshold or a == b:
            break
        a, b = min(a, b), max(a, b)
        merged = np.minimum(bw[a], bw[b])
        bw[a], bw[:, a] = merged, merged
        bw[a, a] = -1.0
        bw = np.delete(np.delete(bw, b, axis=0), b, axis=1)
        groups[a] = sorted(groups[a] + groups[b])
        del groups[b]
    return sorted(groups, key=lambda g: g[0])


def fence_link(hw: Hardware, a: list[int], b: list[int]) -> float:
    """The slowest link from fence a to fence b (what a cut between them must cross)."""
    return min(hw.bps(i, j) for i in a for j in b)


def order_fences(hw: Hardware, fences: list[list[int]], *, exhaustive_up_to: int = 7) -> list[list[int]]:
    """The pipeline order of fences (see the module docstring)."""
    if len(fences) <= 2:
        return sorted(fences, key=lambda f: -_speed(hw, f))

    def score(order: tuple[int, ...]) -> tuple[float, float]:
        links = [fence_link(hw, fences[a], fences[b]) for a, b in itertools.pairwise(order)]
        return (min(links), sum(math.log(x) for x in links))

    if len(fences) <= exhaustive_up_to:
        best = max(itertools.permutations(range(len(fences))), key=score)
    else:  # greedy: start at the fastest fence, always continue over the fastest link
        left = set(range(len(fences)))
        cur = max(left, key=lambda f: _speed(hw, fences[f]))
        order = [cur]
        left.remove(cur)
        while left:
            cur = max(left, key=lambda f: fence_link(hw, fences[order[-1]], fences[f]))
            order.append(cur)
            left.remove(cur)
        best = tuple(order)
    return [fences[i] for i in best]


def _speed(hw: Hardware, fence: list[int]) -> float:
    return sum((hw.devices[i].flops or 0) * 1e-9 + (hw.devices[i].cpus or 0) for i in fence)
