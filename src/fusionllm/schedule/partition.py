"""Cutting the topological order of an OpGraph into contiguous stages on a chain of devices.

``split_chain`` minimises the slowest stage, where a stage's time per micro-batch is the larger of
its compute (forward and backward on its devices) and the transfer of the tensors crossing the cut
after it, on the link to the next stage. It bisects on that bottleneck; for a given bound it walks
the chain greedily, giving each device as many ops as fit and then cutting at the latest position
whose crossing tensors fit the link. Devices left over stay unused (a shorter pipeline).
A chain element may be a group of replicas: its compute is shared among them.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fusionllm.cost.model import HEADER_BYTES, CostModel
from fusionllm.graph.ir import OpGraph


def cut_bytes(graph: OpGraph) -> list[int]:
    """cut[i]: bytes of the float tensors produced by ops[:i+1] and read by ops[i+1:] (per micro-batch)."""
    ops = graph.compute_nodes
    pos = {n.id: i for i, n in enumerate(ops)}
    last: dict[str, int] = {}
    for n in ops:
        for e in n.inputs:
            last[e] = max(last.get(e, -1), pos[n.id])
    delta = [0] * (len(ops) + 1)
    for n in ops:
        for e in n.outputs:
            end = last.get(e.id, -1)
            if end > pos[n.id] and e.requires_grad:
                delta[pos[n.id]] += e.meta.nbytes
                delta[end] -= e.meta.nbytes
    out, run = [], 0
    for i in range(len(ops)):
        run += delta[i]
        out.append(run)
    return out


@dataclass(frozen=True)
class Element:
    """One place in the chain: a device, or several replicas of one stage."""

    workers: tuple[int, ...]


def op_seconds_per_element(cost: CostModel, ops: Sequence[str], element: Element) -> list[float]:
    """Forward + backward seconds of each op on an element, under sustained load, per micro-batch."""
    return list(_element_vector(cost, ops, element))


def _element_vector(cost: CostModel, ops: Sequence[str], element: Element) -> np.ndarray:
    pos = cost.positions()
    first, last = pos[ops[0]], pos[ops[-1]]
    if last - first + 1 == len(ops):  # a contiguous run of the topological order (every stage is one)
        rows = [cost.op_vector(cost.hw.devices[w])[first : last + 1] for w in element.workers]
    else:
        idx = np.fromiter((pos[n] for n in ops), int, len(ops))
        rows = [cost.op_vector(cost.hw.devices[w])[idx] for w in element.workers]
    if len(rows) == 1:
        return rows[0]
    # replicas take micro-batches round robin: the slowest sets the pace, shared by all of them
    return np.max(np.stack(rows), axis=0) / len(rows)


def slowest_pair(cost: CostModel, src: Sequence[int], dst: Sequence[int]) -> tuple[int, int]:
    """The pair (a in src, b in dst) whose link carries raw bytes slowest (bandwidth / codec ratio)."""
    if len(src) == 1 and len(dst) == 1:
        return src[0], dst[0]
    if "bw" not in cost.memo:
        cost.memo["bw"] = np.array(cost.hw.bandwidth, dtype=float)
    eff = cost.memo["bw"][np.ix_(list(src), list(dst))].copy()
    if cost.ratios:
        for i, a in enumerate(src):
            for j, b in enumerate(dst):
                eff[i, j] /= cost.ratio(a, b)
    i, j = np.unravel_index(int(np.argmin(eff)), eff.shape)
    return src[int(i)], dst[int(j)]


def split_chain(cost: CostModel, ops: Sequence[str], chain: Sequence[Element], cuts: Sequence[int], *, iterations: int = 60, tolerance: float = 1e-3) -> list[tuple[Element, list[str]]] | None:
    """Stages (element, ops) covering ``ops`` in order; None if no split fits."""
    n = len(ops)
    if n == 0 or not chain:
        return None
    times = [_element_vector(cost, ops, el) for el in chain]
    prefix = [np.concatenate([[0.0], np.cumsum(t)]) for t in times]
    overhead = 2 * cost.action_overhead_s

    # seconds to send the tensors crossing a cut after op c-1 over the slowest link of chain step k
    cut_arr = np.array([cost.edge_bytes(x) for x in cuts], dtype=float)
    links = []
    for k in range(len(chain) - 1):
        x, y = slowest_pair(cost, chain[k].workers, chain[k + 1].workers)
        bps = cost.hw.bps(x, y)
        per_byte = 8 * cost.ratio(x, y) / bps if np.isfinite(bps) else 0.0
        fixed = (HEADER_BYTES * 8 / bps if np.isfinite(bps) else 0.0) + cost.message_overhead_s + cost.latency(x, y)
        links.append(np.concatenate([[np.inf], cut_arr * per_byte + fixed]))  # index c: the cut before op c

    def link_time(k: int, c: int) -> float:
        return float(links[k][c])

    plists = [p.tolist() for p in prefix]

    def walk(bound: float) -> list[tuple[int, int, int]] | None:
        i, out = 0, []
        for k in range(len(chain)):
            if i == n:
                break
            # the furthest j with prefix[j] - prefix[i] + overhead <= bound
            j = bisect.bisect_right(plists[k], plists[k][i] + bound - overhead) - 1
            j = min(max(j, i), n)
            if j == i:
                return None
            if j == n:
                out.append((k, i, n))
                i = n
                break
            if k == len(chain) - 1:
                return None
            ok = np.flatnonzero(links[k][i + 1 : j + 1] <= bound)
            if len(ok) == 0:
                return None
            c = i + 1 + int(ok[-1])
            out.append((k, i, c))
            i = c
        return out if i == n else None

    lo = max(float(t.min()) for t in times) if times else 0.0
    hi = max(float(p[-1]) for p in prefix) + overhead + max((link_time(k, c) for k in range(len(chain) - 1) for c in (1,)), default=0.0) + 1.0
    best = walk(hi * 1e6)
    if best is None:
        return None
    # bisect in log space to a relative tolerance: the result does not depend on how many steps
    # a fixed count would take from an arbitrary upper bound
    lo = max(lo, hi * 1e-9)
    for _ in range(iterations):
        if hi <= lo * (1 + tolerance):
            break
        mid = math.sqrt(lo * hi)
        got = walk(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    return [(chain[k], list(ops[i:j])) for k, i, j in best]
