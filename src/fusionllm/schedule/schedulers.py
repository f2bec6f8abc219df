"""Schedulers: OpGraph + cost model -> Plan. OP-Fence and three baselines behind one interface.

- ``uniform``: equal numbers of ops per device, devices in the given order (the usual pipeline example);
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
    size, extra = divmod(len(ops), k)
    stages, start = [], 0
    for d in range(k):
        end = start + size + (1 if d < extra else 0)
        stages.append(((d,), ops[start:end]))
        start = end
    return _plan(stages, req, "uniform")


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


def opfence(cost: CostModel, req: Request, *, budget_s: float = 4.0) -> Plan:
    from fusionllm.sim.simulator import simulate  # noqa: PLC0415 - schedule -> sim only for choosing

    started = time.perf_counter()
    hw = cost.hw
    graph = cost.graph
    ops = [n.id for n in graph.compute_nodes]
    cuts = cut_bytes(graph)
    fences = order_fences(hw, find_fences(hw))
    speed = {d.index: (d.flops or 0) + (d.cpus or 0) * 1e12 for d in hw.devices}
    # chains of fences to try: all of them, and leaving out one fence (a site behind a slow link)
    subsets = [fences]
    if 1 < len(fences) <= 8:
        subsets += [[f for f in fences if f is not skip] for skip in fences]
        subsets += [[f] for f in fences]
    layouts: list[tuple[str, list[tuple[tuple[int, ...], list[str]]]]] = []
    for subset in subsets:
        for mode in ("pipeline", "replicate"):
            chain: list[Element] = []
            for fence in subset:
                members = sorted(fence, key=lambda d: -speed[d])
                if mode == "pipeline" or len(members) == 1:
                    chain += [Element((d,)) for d in members]
                else:
                    chain.append(Element(tuple(members)))
            split = split_chain(cost, ops, chain, cuts)
            if split is not None:
                layouts.append((f"{mode}:{len(subset)}f", [(el.workers, nodes) for el, nodes in split]))
    for name, base in (("params", params), ("uniform", uniform), ("compute", compute)):
        p = base(cost, req)
        layouts.append((f"like-{name}", [(tuple(s.workers), s.nodes) for s in p.stages]))
    best: tuple[float, Plan] | None = None
    divisors = [m for m in range(1, req.batch_size + 1) if req.batch_size % m == 0]
    seen = set()
    for name, stages in layouts:
        key = repr(stages)
        if key in seen:
            continue
        seen.add(key)
        depth = len(stages)
        widest = max(len(w) for w, _ in stages)
        choices = sorted({m for m in divisors if m >= widest and m <= 8 * max(depth, widest)} | {req.micro_batches} & set(divisors))
        for m in choices:
            plan = _plan(stages, req, "opfence", m, "1f1b")
            if not _fits(cost.scaled(micro_batch_scale(cost.graph, req, m)), plan):
                continue
            t = simulate(plan, cost, req).step_time_s
            if best is None or t < best[0]:
                plan.meta.update({"layout": name, "fences": fences})
                best = (t, plan)
        if time.perf_counter() - started > budget_s and best is not None:
            break
    if best is None:
        raise ConfigError("no plan fits the devices' memory; use more devices or a smaller model")
    return best[1]


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
    return {k: getattr(cost, k) for k in ("gpu_efficiency", "op_overhead_s", "action_overhead_s", "message_overhead_s", "step_overhead_s", "optimizer_bytes_per_s", "cpu_serialize_bytes_per_s")}


SCHEDULER_FUNCS: dict[str, Callable[[CostModel, Request], Plan]] = {"opfence": opfence, "uniform": uniform, "params": params, "compute": compute}


def make_schedule(name: str, cost: CostModel, req: Request) -> Plan:
    if name not in SCHEDULER_FUNCS:
        raise ConfigError(f"unknown scheduler {name!r}; choose one of {', '.join(SCHEDULERS)}")
    return SCHEDULER_FUNCS[name](cost, req)
