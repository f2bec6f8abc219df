"""Schedulers: OpGraph + cost model -> Plan. OP-Fence and three baselines behind one interface.

- ``uniform``: equal numbers of the model's repeated blocks per device (the transformer layers; equal
  numbers of ops for a model without repeated blocks), devices in the given order: the usual
  pipeline example, and the split ``torch.distributed.pipelining`` users write by hand;
- ``params``: stages balanced by parameter count, devices in the given order (DeepSpeed's default);
- ``compute``: stage work proportional to device speed, devices in the given order, bandwidth-blind;
- ``opfence``: fences of similar fast links, ordered so the crossing tensors take the best links,
  cuts where the crossing tensors are small, replicas inside a fence where they pay, the number of
  micro-batches and the schedule chosen by simulating the candidates (docs/scheduler.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from fusionllm.core.errors import ConfigError
from fusionllm.cost.model import CostModel
from fusionllm.graph.ir import OpGraph
from fusionllm.schedule.fences import find_fences, order_fences
from fusionllm.schedule.partition import Element, cut_bytes, split_chain
from fusionllm.schedule.plan import Plan, Request, StagePlan, balanced_partition, micro_batch_scale

SCHEDULERS = ("opfence", "uniform", "params", "compute")


def _plan(stages: list[tuple[tuple[int, ...], list[str]]], req: Request, scheduler: str, micro_batches: int | None = None, schedule: str | None = None) -> Plan:
    return Plan(
        [StagePlan(i, nodes, list(workers)) for i, (workers, nodes) in enumerate(stages)],
        schedule or req.schedule,
        micro_batches or req.micro_batches,
        {"scheduler": scheduler},
    )


def uniform(cost: CostModel, req: Request) -> Plan:
    ops = [n.id for n in cost.graph.compute_nodes]
    k = min(len(cost.hw), len(ops))
    blocks = repeated_blocks(cost.graph)
    if len(blocks) >= k:  # cut before block round(i * n / k): what the peer's split_spec does
        cuts = [0] + [blocks[round(i * len(blocks) / k)] for i in range(1, k)] + [len(ops)]
    else:
        size, extra = divmod(len(ops), k)
        cuts = [0]
        for d in range(k):
            cuts.append(cuts[-1] + size + (1 if d < extra else 0))
    stages = [((d,), ops[cuts[d] : cuts[d + 1]]) for d in range(k)]
    return _plan(stages, req, "uniform")


def repeated_blocks(graph: OpGraph) -> list[int]:
    """Positions, among the compute nodes, of the most frequent op kind that carries parameters
    and occurs more than once (a transformer's blocks); empty when there is none."""
    nodes = graph.compute_nodes
    counts: dict[str, int] = {}
    for n in nodes:
        if n.params:
            counts[n.kind] = counts.get(n.kind, 0) + 1
    best = max(counts.items(), key=lambda kv: kv[1], default=("", 0))
    return [i for i, n in enumerate(nodes) if n.kind == best[0]] if best[1] > 1 else []


def params(cost: CostModel, req: Request) -> Plan:
    parts = balanced_partition(cost.graph, min(len(cost.hw), len(cost.graph.compute_nodes)))
    return _plan([((d,), p) for d, p in enumerate(parts)], req, "params")


def compute(cost: CostModel, req: Request) -> Plan:
    """Work proportional to speed: split_chain over devices in order with links taken as free."""
    free = CostModel(cost.graph, cost.work, _infinite_links(cost), **_knobs(cost))
    ops = [n.id for n in cost.graph.compute_nodes]
    chain = [Element((d,)) for d in range(len(cost.hw))]
    stages = split_chain(free, ops, chain, [0] * len(ops))
    if stages is None:
        raise ConfigError("the compute scheduler found no split")
    return _plan([(el.workers, nodes) for el, nodes in stages], req, "compute")


Evaluate = Callable[[Plan, CostModel, Request], float]


def opfence(cost: CostModel, req: Request, *, evaluate: Evaluate | None = None, budget_s: float = 4.0) -> Plan:
    """``evaluate`` predicts a plan's step time (the simulator, given by the caller: the scheduler
    sits below it); without it the closed-form estimate decides alone."""
    started = time.perf_counter()
    hw = cost.hw
    graph = cost.graph
    ops = [n.id for n in graph.compute_nodes]
    cuts = cut_bytes(graph)
    fences = order_fences(hw, find_fences(hw))
    speed = {d.index: (d.flops or 0) + (d.cpus or 0) * 1e12 for d in hw.devices}
    # chains of fences to try: every contiguous run of the ordered fences (a site behind a slow
    # link drops out), and in each fence every replication factor (1: a pipeline through its devices)
    n_f = len(fences)
    windows = [fences[i:j] for i in range(n_f) for j in range(i + 1, n_f + 1)] if n_f <= 12 else [fences, fences[:1]]
    windows.sort(key=lambda w: -len(w))
    layouts: list[tuple[str, list[tuple[tuple[int, ...], list[str]]]]] = []
    for window in windows:
        factors = sorted({r for fence in window for r in _factors(len(fence))})
        for r in factors:
            chain: list[Element] = []
            for fence in window:
                members = sorted(fence, key=lambda d: -speed[d])
                rr = r if len(members) % r == 0 else 1
                chain += [Element(tuple(members[k : k + rr])) for k in range(0, len(members), rr)]
            # the whole chain, and shorter pipelines on its first elements (less fill, fewer messages)
            for depth in sorted({len(chain), *(d for d in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if d < len(chain))}):
                split = split_chain(cost, ops, chain[:depth], cuts)
                if split is not None:
                    layouts.append((f"{len(window)} fences, replicas {r}, depth {len(split)}", [(el.workers, nodes) for el, nodes in split]))
    for name, base in (("params", params), ("uniform", uniform), ("compute", compute)):
        p = base(cost, req)
        layouts.append((f"like {name}", [(tuple(s.workers), s.nodes) for s in p.stages]))
    divisors = [m for m in range(1, req.batch_size + 1) if req.batch_size % m == 0]

    def score(stages: list[tuple[tuple[int, ...], list[str]]], m: int) -> tuple[float, Plan] | None:
        plan = _plan(stages, req, "opfence", m, "1f1b")
        scaled = cost.scaled(micro_batch_scale(cost.graph, req, m))
        if not _fits(scaled, plan):
            return None
        if evaluate is None:
            return _estimate(scaled, stages, m), plan
        return evaluate(plan, cost, req), plan

    def m_choices(stages: list[tuple[tuple[int, ...], list[str]]]) -> list[int]:
        depth, widest = len(stages), max(len(w) for w, _ in stages)
        return sorted({m for m in divisors if widest <= m <= 4 * max(depth, widest)} | ({req.micro_batches} & set(divisors)))

    # rank every (layout, micro-batches) by a closed-form estimate, then simulate the best few
    ranked: list[tuple[float, str, list[tuple[tuple[int, ...], list[str]]], int]] = []
    seen: set[str] = set()
    for name, stages in layouts:
        key = repr(stages)
        if key in seen:
            continue
        seen.add(key)
        for m in m_choices(stages):
            ranked.append((_estimate(cost.scaled(micro_batch_scale(cost.graph, req, m)), stages, m), name, stages, m))
    ranked.sort(key=lambda x: x[0])
    best: tuple[float, Plan] | None = None
    for i, (_, name, stages, m) in enumerate(ranked):
        got = score(stages, m)
        if got is not None and (best is None or got[0] < best[0]):
            got[1].meta.update({"layout": name, "fences": fences})
            best = got
        if best is not None and (i >= 12 or time.perf_counter() - started > budget_s):
            break
    if best is None:
        raise ConfigError("no plan fits the devices' memory; use more devices or a smaller model")
    return best[1]


def _estimate(cost: CostModel, stages: list[tuple[tuple[int, ...], list[str]]], m: int) -> float:
    """Closed-form step time: one micro-batch through the pipeline, then the rest at the bottleneck,
    plus the all-reduce of shared gradients (replicas, tied weights). Counts what the simulator
    counts: compute, the CPU time of every message at both ends, and the links."""
    from fusionllm.schedule.partition import op_seconds_per_element

    graph = cost.graph
    if "readers" not in cost.memo:
        cost.memo["readers"] = graph.consumers()
    readers = cost.memo["readers"]
    where = {n: k for k, (_, nodes) in enumerate(stages) for n in nodes}
    crossing = [0.0] * len(stages)  # bytes leaving stage k per micro-batch (to any later stage)
    for k, (_, nodes) in enumerate(stages):
        for n in nodes:
            for e in graph.node(n).outputs:
                if e.requires_grad and any(where.get(c, k) > k for c in readers.get(e.id, ())):
                    crossing[k] += cost.edge_bytes(e.meta.nbytes)
    fill, bottleneck = 0.0, 0.0
    for k, (workers, nodes) in enumerate(stages):
        per_op = op_seconds_per_element(cost, nodes, Element(workers))
        messages = 2 * cost.message_cpu_seconds(crossing[k]) + (2 * cost.message_cpu_seconds(crossing[k - 1]) if k else 0.0)
        stage = (sum(per_op) + 2 * cost.action_overhead_s) * len(workers) + messages
        fill += stage
        bottleneck = max(bottleneck, stage / len(workers))
        if k + 1 < len(stages):
            nxt = stages[k + 1][0]
            link = max(cost.transfer_seconds(int(crossing[k]), a, b) + cost.latency(a, b) for a in workers[:1] for b in nxt[:1])
            fill += 2 * link
            bottleneck = max(bottleneck, link)
    holders: dict[str, set[int]] = {}
    for workers, nodes in stages:
        for n in nodes:
            for p in graph.node(n).params.values():
                if graph.params[p].trainable:
                    holders.setdefault(p, set()).update(workers)
    groups: dict[tuple[int, ...], int] = {}
    for p, ws in holders.items():
        if len(ws) > 1:
            groups[tuple(sorted(ws))] = groups.get(tuple(sorted(ws)), 0) + graph.params[p].meta.nbytes
    reduce = 0.0
    for group, nbytes in groups.items():
        rounds = 2 * (len(group) - 1)
        reduce += rounds * (cost.allreduce_round_seconds(nbytes, list(group)) + 2 * cost.message_cpu_seconds(nbytes / len(group)))
    width = max(1, min(len(w) for w, _ in stages))
    return fill + max(0.0, m / width - 1) * bottleneck + reduce + cost.step_overhead_s


def _factors(n: int) -> list[int]:
    return [r for r in range(1, n + 1) if n % r == 0]


def _fits(cost: CostModel, plan: Plan) -> bool:
    for i, s in enumerate(plan.stages):
        in_flight = plan.micro_batches if plan.schedule == "gpipe" else min(plan.micro_batches, len(plan.stages) - i)
        need = cost.stage_memory(s.nodes, in_flight)  # cost already scaled to the plan's micro-batch
        if any(need > cost.hw.devices[w].memory for w in s.workers):
            return False
    return True


def _infinite_links(cost: CostModel):  # noqa: ANN202
    from fusionllm.cluster.hardware import Hardware

    n = len(cost.hw)
    inf = float("inf")
    return Hardware(cost.hw.devices, tuple(tuple(inf for _ in range(n)) for _ in range(n)), tuple(tuple(0.0 for _ in range(n)) for _ in range(n)), cost.hw.name)


def _knobs(cost: CostModel) -> dict:
    return {k: getattr(cost, k) for k in ("gpu_efficiency", "op_overhead_s", "action_overhead_s", "message_overhead_s", "message_cpu_s", "cpu_bytes_per_s", "step_overhead_s", "optimizer_bytes_per_s")}


SCHEDULER_FUNCS: dict[str, Callable[[CostModel, Request], Plan]] = {"opfence": opfence, "uniform": uniform, "params": params, "compute": compute}


def make_schedule(name: str, cost: CostModel, req: Request, *, evaluate: Evaluate | None = None) -> Plan:
    if name not in SCHEDULER_FUNCS:
        raise ConfigError(f"unknown scheduler {name!r}; choose one of {', '.join(SCHEDULERS)}")
    if name == "opfence":
        return opfence(cost, req, evaluate=evaluate)
    return SCHEDULER_FUNCS[name](cost, req)
