"""Schedulers: OpGraph + cost model -> Plan. OP-Fence and three baselines behind one interface.

- ``uniform``: equal numbers of the model's repeated blocks per device (the transformer layers; equal
  numbers of ops for a model without repeated blocks), devices in the given order: the usual
  pipeline example, and the split ``torch.distributed.pipelining`` users write by hand;
- ``params``: stages balanced by parameter count, devices in the given order (DeepSpeed's default);
- ``compute``: stage work proportional to device speed, devices in the given order, bandwidth-blind;
- ``opfence``: fences of similar fast links, ordered so the crossing tensors take the best links,
  cuts where the crossing tensors are small, replicas inside a fence where they pay, the number of
  micro-batches and the schedule chosen by simulating the candidates (docs/scheduler.md); then
  weighed against the best data-parallel plan by predicted goodput (``planning/data_parallel.py``);
- ``dp``: that data-parallel plan alone: replicas (or replicated pipelines) with shares of the batch
  in proportion to their speed, their gradients summed across sites compressed where links are slow.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np

from fusionllm.cluster.hardware import Device
from fusionllm.core.errors import ConfigError
from fusionllm.core.options import SCHEDULERS
from fusionllm.cost.model import CostModel
from fusionllm.graph.ir import OpGraph
from fusionllm.planning.data_parallel import DP_CANDIDATES, data_parallel, weigh
from fusionllm.planning.fences import find_fences, order_fences
from fusionllm.planning.predict import predict
from fusionllm.schedule.partition import Element, cut_bytes, split_chain
from fusionllm.schedule.plan import Plan, Request, StagePlan, balanced_partition, micro_batch_scale
from fusionllm.schedule.validate import InvalidPlan, validate_plan


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


DEFAULT_CANDIDATES = 12  # plans OP-Fence simulates (after ranking all by the closed form); see docs/scheduler.md
MAX_INVALID = 400  # invalid candidates OP-Fence may meet before it gives up (each is counted)

Layout = list[tuple[tuple[int, ...], list[str]]]


def opfence(cost: CostModel, req: Request, *, evaluate: Evaluate | None = None, candidates: int = DEFAULT_CANDIDATES) -> Plan:
    """``evaluate`` predicts a plan's step time and raises InvalidPlan for a plan that cannot run
    (usually ``planning.predict``, the simulator, which validates what it runs; the caller may wrap
    it, e.g. with a placement constraint); without it the validator and the closed-form estimate decide alone. The search is bounded by the
    number of ``candidates`` simulated, never by the clock: the same inputs give the same plan on
    any machine, however busy. Every candidate is validated (``schedule.validate``) before it is
    judged; invalid ones are discarded and counted in ``plan.meta["invalid_candidates"]``."""
    if candidates < 1:
        raise ConfigError(f"--plan-candidates must be >= 1, got {candidates}")
    hw = cost.hw
    graph = cost.graph
    ops = [n.id for n in graph.compute_nodes]
    cuts = cut_bytes(graph)
    fences = order_fences(hw, find_fences(hw))
    speed = {d.index: device_speed(d) for d in hw.devices}
    # chains of fences to try: every contiguous run of the ordered fences (a site behind a slow
    # link drops out), and in each fence every replication factor (1: a pipeline through its devices)
    n_f = len(fences)
    windows = [fences[i:j] for i in range(n_f) for j in range(i + 1, n_f + 1)] if n_f <= 12 else [fences, fences[:1]]
    windows.sort(key=lambda w: -len(w))
    layouts: list[tuple[str, Layout]] = []
    splits: dict[tuple[Element, ...], list[tuple[Element, list[str]]] | None] = {}
    for window in windows:
        factors = sorted({r for fence in window for r in _factors(len(fence))})
        for r in factors:
            chain: list[Element] = []
            for fence in window:
                members = sorted(fence, key=lambda d: (-speed[d], d))
                rr = r if len(members) % r == 0 else 1
                chain += [Element(tuple(members[k : k + rr])) for k in range(0, len(members), rr)]
            # the whole chain, and shorter pipelines on its first elements (less fill, fewer messages)
            for depth in sorted({len(chain), *(d for d in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if d < len(chain))}):
                key = tuple(chain[:depth])
                if key not in splits:  # windows share their first elements: split each chain once
                    splits[key] = split_chain(cost, ops, chain[:depth], cuts)
                split = splits[key]
                if split is not None:
                    layouts.append((f"{len(window)} fences, replicas {r}, depth {len(split)}", [(el.workers, nodes) for el, nodes in split]))
    for name, base in (("params", params), ("uniform", uniform), ("compute", compute)):
        p = base(cost, req)
        layouts.append((f"like {name}", [(tuple(s.workers), s.nodes) for s in p.stages]))
    # a stage without trainable parameters (the token positions alone, say) idles its device: the
    # variant with that stage merged into its neighbour is a candidate too, and wins unless the
    # cost model prefers the pass-through (docs/scheduler.md, "Plans that make sense")
    layouts += [(f"{name}, pass-through merged", merged) for name, stages in list(layouts) if (merged := merge_pass_through(graph, stages)) != stages]
    layouts = [(name, stages) for name, stages in layouts if sensible(graph, stages, speed)]
    divisors = [m for m in range(1, req.batch_size + 1) if req.batch_size % m == 0]

    def m_choices(stages: Layout) -> list[int]:
        depth, widest = len(stages), max(len(w) for w, _ in stages)
        if depth == widest == 1:  # one device: nothing to fill or share, a micro-batch more is only overhead (issue 58)
            return [1]
        return sorted({m for m in divisors if widest <= m <= 4 * max(depth, widest)} | ({req.micro_batches} & set(divisors)))

    # rank every (layout, micro-batches) by a closed-form estimate, then validate and simulate the best
    ranked: list[tuple[float, int, str, Layout, int]] = []
    seen: set[str] = set()
    for order, (name, stages) in enumerate(layouts):
        key = repr(stages)
        if key in seen:
            continue
        seen.add(key)
        for m in m_choices(stages):
            ranked.append((_estimate(cost.scaled(micro_batch_scale(cost.graph, req, m)), stages, m), order, name, stages, m))
    ranked.sort(key=lambda x: (x[0], x[1], x[4]))  # ties: the earlier layout, fewer micro-batches
    best: tuple[float, Plan] | None = None
    judged, invalid = 0, Counter[str]()
    first_invalid = ""
    for _, _, name, stages, m in ranked:
        plan = _plan(stages, req, "opfence", m, "1f1b")
        try:  # the simulator validates what it runs; the closed form needs the validator first
            if evaluate is None:
                validate_plan(graph, plan, cost, req)
                t = _estimate(cost.scaled(micro_batch_scale(graph, req, m)), stages, m)
            else:
                t = evaluate(plan, cost, req)
        except InvalidPlan as exc:
            invalid[exc.rule] += 1
            first_invalid = first_invalid or str(exc)
            if sum(invalid.values()) >= MAX_INVALID:
                break
            continue
        judged += 1
        if best is None or t < best[0]:
            plan.meta.update({"layout": name, "fences": fences})
            best = (t, plan)
        if judged >= candidates:
            break
    if best is None:
        if invalid and set(invalid) != {"memory"}:
            raise ConfigError(f"OP-Fence found no valid plan: {first_invalid}")
        raise ConfigError("no plan fits the devices' memory; use more devices, devices with more memory, or a smaller model")
    best[1].meta.update({"candidates": {"layouts": len(seen), "ranked": len(ranked), "judged": judged, "invalid": dict(invalid)}})
    return best[1]


def device_speed(d: Device) -> float:
    """A sort key for devices: accelerators by peak FLOP/s, CPU shares by their quota."""
    return (d.flops or 0) + (d.cpus or 0) * d.speed * 1e12


def merge_pass_through(graph: OpGraph, stages: Layout) -> Layout:
    """The layout with every stage that holds no trainable parameter merged into its neighbour (the
    next stage; the last one into the stage before it). Its device then drops out of the plan."""
    out = [(w, list(nodes)) for w, nodes in stages]
    k = 0
    while len(out) > 1 and k < len(out):
        if has_params(graph, out[k][1]):
            k += 1
            continue
        if k + 1 < len(out):
            out[k + 1] = (out[k + 1][0], out[k][1] + out[k + 1][1])
        else:
            out[k - 1] = (out[k - 1][0], out[k - 1][1] + out[k][1])
        del out[k]
    return out


def sensible(graph: OpGraph, stages: Layout, speed: dict[int, float]) -> bool:
    """A stage without trainable parameters sits only on the slowest device of the layout: a
    pass-through on a faster device leaves that device idle while slower ones compute."""
    slowest = min(speed[w] for workers, _ in stages for w in workers)
    return all(has_params(graph, nodes) or all(speed[w] <= slowest for w in workers) for workers, nodes in stages)


def has_params(graph: OpGraph, nodes: list[str]) -> bool:
    return any(graph.params[p].trainable for n in nodes for p in graph.node(n).params.values())


def _estimate(cost: CostModel, stages: list[tuple[tuple[int, ...], list[str]]], m: int) -> float:
    """Closed-form step time: one micro-batch through the pipeline, then the rest at the bottleneck,
    plus the all-reduce of shared gradients (replicas, tied weights). Counts what the simulator
    counts: compute, the CPU time of every message at both ends, and the links."""
    from fusionllm.schedule.partition import op_seconds_per_element

    crossing, groups = _crossing_and_shared(cost, stages)
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
    reduce = 0.0
    for group, nbytes in groups.items():
        rounds = 2 * (len(group) - 1)
        reduce += rounds * (cost.allreduce_round_seconds(nbytes, list(group)) + 2 * cost.message_cpu_seconds(nbytes / len(group)))
    width = max(1, min(len(w) for w, _ in stages))
    return fill + max(0.0, m / width - 1) * bottleneck + reduce + cost.step_overhead_s


def _layout_arrays(cost: CostModel) -> dict:
    """Per graph, once: every float tensor (its producer's position, its last reader's, its bytes)
    and every trainable parameter (the positions of the ops that use it)."""
    if "layout_arrays" not in cost.memo:
        graph = cost.graph
        pos = cost.positions()
        readers = graph.consumers()
        prod, last, size = [], [], []
        for n in graph.compute_nodes:
            for e in n.outputs:
                ends = [pos[c] for c in readers.get(e.id, ()) if c in pos]
                if e.requires_grad and ends and max(ends) > pos[n.id]:
                    prod.append(pos[n.id])
                    last.append(max(ends))
                    size.append(e.meta.nbytes)
        users: dict[str, list[int]] = {}
        for n in graph.compute_nodes:
            for p in dict.fromkeys(n.params.values()):
                if graph.params[p].trainable:
                    users.setdefault(p, []).append(pos[n.id])
        names = list(users)
        cost.memo["layout_arrays"] = {
            "prod": np.array(prod, dtype=int), "last": np.array(last, dtype=int), "bytes": np.array(size, dtype=float),
            "user_pos": np.array([x for p in names for x in users[p]], dtype=int),  # every (parameter, op using it)
            "user_param": np.array([k for k, p in enumerate(names) for _ in users[p]], dtype=int),
            "param_bytes": [graph.params[p].meta.nbytes for p in names],
        }
    return cost.memo["layout_arrays"]


def _crossing_and_shared(cost: CostModel, stages: Layout) -> tuple[list[float], dict[tuple[int, ...], int]]:
    """Bytes leaving each stage per micro-batch (to any later stage), and the bytes of gradients
    each group of workers shares (replicas, tied weights). Stages are contiguous runs of the order."""
    arrays = _layout_arrays(cost)
    pos = cost.positions()
    ends = np.array([pos[nodes[-1]] + 1 for _, nodes in stages], dtype=int)
    where = np.searchsorted(ends, arrays["prod"], side="right")  # the stage of each tensor's producer
    leaves = arrays["last"] >= ends[np.minimum(where, len(stages) - 1)]
    sizes = np.floor(arrays["bytes"] * cost.scale)
    crossing = np.bincount(where[leaves], weights=sizes[leaves], minlength=len(stages)).tolist()
    groups: dict[tuple[int, ...], int] = {}
    if len(arrays["user_pos"]):
        n_stages = len(stages)
        pairs = np.unique(arrays["user_param"] * n_stages + np.searchsorted(ends, arrays["user_pos"], side="right"))
        param, stage = np.divmod(pairs, n_stages)
        width = np.array([len(w) for w, _ in stages])
        stages_per_param = np.bincount(param, minlength=len(arrays["param_bytes"]))
        shared = (stages_per_param[param] > 1) | (width[stage] > 1)  # held by more than one worker
        holders: dict[int, set[int]] = {}
        for p, k in zip(param[shared].tolist(), stage[shared].tolist(), strict=True):
            holders.setdefault(p, set()).update(stages[k][0])
        for p, ws in holders.items():
            key = tuple(sorted(ws))
            groups[key] = groups.get(key, 0) + arrays["param_bytes"][p]
    return crossing, groups


def _factors(n: int) -> list[int]:
    return [r for r in range(1, n + 1) if n % r == 0]


def _infinite_links(cost: CostModel):  # noqa: ANN202
    from fusionllm.cluster.hardware import Hardware

    n = len(cost.hw)
    inf = float("inf")
    return Hardware(cost.hw.devices, tuple(tuple(inf for _ in range(n)) for _ in range(n)), tuple(tuple(0.0 for _ in range(n)) for _ in range(n)), cost.hw.name)


def _knobs(cost: CostModel) -> dict:
    """Every constant of the cost model (a knob added later is carried over too)."""
    from dataclasses import fields

    return {f.name: getattr(cost, f.name) for f in fields(cost) if f.name not in ("graph", "work", "hw", "ratios", "scale", "memo")}


SCHEDULER_FUNCS: dict[str, Callable[[CostModel, Request], Plan]] = {"opfence": opfence, "uniform": uniform, "params": params, "compute": compute,
                                                                    "dp": data_parallel}


def make_schedule(name: str, cost: CostModel, req: Request, *, evaluate: Evaluate | None = None, candidates: int = DEFAULT_CANDIDATES) -> Plan:
    """The named scheduler's plan, validated: a plan this returns runs (``schedule.validate``), or
    an error says why there is none (a baseline's layout that does not fit memory, say)."""
    if name not in SCHEDULER_FUNCS:
        raise ConfigError(f"unknown scheduler {name!r}; choose one of {', '.join(SCHEDULERS)}")
    if name == "opfence":  # OP-Fence's pipelines, and data parallelism across the fences beside them
        pipeline = opfence(cost, req, evaluate=evaluate, candidates=candidates)
        return weigh(pipeline, cost, req, evaluate=evaluate or predict, candidates=min(candidates, DP_CANDIDATES))
    if name == "dp":
        return data_parallel(cost, req, evaluate=evaluate, candidates=min(candidates, DP_CANDIDATES))
    plan = SCHEDULER_FUNCS[name](cost, req)
    try:
        validate_plan(cost.graph, plan, cost, req)
    except InvalidPlan as exc:
        if exc.rule == "memory":
            raise ConfigError(f"the {name} scheduler's plan does not fit: {str(exc).split(': ', 1)[1]}; try --scheduler opfence, more devices or a smaller model") from None
        raise
    return plan
