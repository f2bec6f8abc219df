"""Cutting the topological order of an OpGraph into contiguous stages on a chain of devices.

``split_chain`` minimises the slowest stage, where a stage's time per micro-batch is the larger of
its compute (forward and backward on its devices) and the transfer of the tensors crossing the cut
after it, on the link to the next stage. It bisects on that bottleneck; for a given bound it walks
the chain greedily, giving each device as many ops as fit and then cutting at the latest position
whose crossing tensors fit the link. Devices left over stay unused (a shorter pipeline).
A chain element may be a group of replicas: its compute is shared among them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fusionllm.cost.model import CostModel
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
    rates = []
    for w in element.workers:
        d = cost.hw.devices[w]
        rates.append([(cost.op_seconds(n, d, False) + cost.op_seconds(n, d, True)) / cost.cpu_rate(d) for n in ops])
    if len(rates) == 1:
        return rates[0]
    # replicas take micro-batches round robin: the slowest sets the pace, shared by all of them
    return [max(r[i] for r in rates) / len(rates) for i in range(len(ops))]


def split_chain(cost: CostModel, ops: Sequence[str], chain: Sequence[Element], cuts: Sequence[int], *, iterations: int = 40) -> list[tuple[Element, list[str]]] | None:
    """Stages (element, ops) covering ``ops`` in order; None if no split fits."""
    n = len(ops)
    if n == 0 or not chain:
        return None
    times = [op_seconds_per_element(cost, ops, el) for el in chain]
    prefix = []
    for t in times:
        acc, p = 0.0, [0.0]
        for x in t:
            acc += x
            p.append(acc)
        prefix.append(p)
    overhead = 2 * cost.action_overhead_s

    def link_time(k: int, c: int) -> float:
        a, b = chain[k], chain[k + 1]
        return max(cost.transfer_seconds(cost.edge_bytes(cuts[c - 1]), x, y) + cost.latency(x, y) for x in a.workers for y in b.workers)

    def walk(bound: float) -> list[tuple[int, int, int]] | None:
        i, out = 0, []
        for k in range(len(chain)):
            if i == n:
                break
            j = i
            while j < n and prefix[k][j + 1] - prefix[k][i] + overhead <= bound:
                j += 1
            if j == i:
                return None
            if j == n:
                out.append((k, i, n))
                i = n
                break
            if k == len(chain) - 1:
                return None
            c = j
            while c > i and link_time(k, c) > bound:
                c -= 1
            if c == i:
                return None
            out.append((k, i, c))
            i = c
        return out if i == n else None

    lo = max(min(t) for t in times) if times else 0.0
    hi = max(p[-1] for p in prefix) + overhead + max((link_time(k, c) for k in range(len(chain) - 1) for c in (1,)), default=0.0) + 1.0
    best = walk(hi * 1e6)
    if best is None:
        return None
    for _ in range(iterations):
        mid = (lo + hi) / 2
        got = walk(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    return [(chain[k], list(ops[i:j])) for k, i, j in best]
