"""Data parallelism across slow links as a plan kind: replicas that take shares of every step's batch.

A pipeline needs an activation and its gradient to cross every cut for every micro-batch; replicas
need only their summed gradients once a step, and those compress 50-100x with error feedback. On
devices joined by slow links, replicas are then often the faster plan. Two layouts:

- pure data parallel: one stage that holds the whole graph, on each of the ``k`` fastest devices
  that hold it (and on the devices of the fastest fences, fence by fence);
- replicated pipelines: the same split into ``depth`` stages in every *lane*, a lane being ``depth``
  devices of one fence (the fastest together), so activations cross fast links only.

Each lane takes a share of the step's micro-batches in proportion to its speed (micro-batches per
second of its slowest stage, from the cost model: the devices' measured or declared speed);
``share_order`` spreads the shares over the step, so every stage of a lane runs the same
micro-batches. The number of micro-batches is chosen with the shares: more makes the shares finer
and costs each micro-batch's overhead (the cost model knows both).

Where the plan spans more than one site (``find_fences``' groups of fast links), ``Plan.reduce`` says
how the gradients are summed: raw within each site to its fastest device, between those leaders
encoded by AdaTopK's budget (``planning/reduce_codec.py``), and back. Within one site the default
reducers sum them (a ring, or a torch world), exactly as one process would.

The planner weighs a candidate by goodput: tokens/s times the per-token efficiency of its codec
(``reduce_efficiency``); OP-Fence's pipeline and the best data-parallel plan meet in ``weigh``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fusionllm.compress.codecs import byte_ratio, parse_codec
from fusionllm.core.errors import ConfigError
from fusionllm.cost.model import CostModel
from fusionllm.planning.efficiency import REDUCE_EFFICIENCY, UNMEASURED_REDUCE_EFFICIENCY
from fusionllm.planning.fences import find_fences
from fusionllm.planning.reduce_codec import leader_groups, with_reduce_codec
from fusionllm.schedule.partition import Element, cut_bytes, split_chain
from fusionllm.schedule.plan import (
    Plan,
    ReducePlan,
    Request,
    StagePlan,
    micro_batch_scale,
    shared_groups,
)
from fusionllm.schedule.validate import InvalidPlan, validate_plan

DP_CANDIDATES = 6  # data-parallel plans simulated (after ranking every one by the closed form)
MAX_LANES = 64

Evaluate = Callable[[Plan, CostModel, Request], float]


def reduce_efficiency(codec: str) -> float:
    """Per-token efficiency of a plan whose replicas' gradients cross sites with ``codec`` (1: raw)."""
    return 1.0 if parse_codec(codec).lossless else REDUCE_EFFICIENCY.get(str(parse_codec(codec)), UNMEASURED_REDUCE_EFFICIENCY)


def apportion(weights: list[float], total: int, fixed: list[float] | None = None) -> list[int] | None:
    """``total`` split over lanes of ``weights`` (micro-batches per second), each at least 1, so that
    the last lane done is done first: the least max of ``fixed[i] + share[i] / weights[i]`` (``fixed``:
    a lane's seconds a step beyond its micro-batches, its reduce and optimizer; 0 without). Greedy, one
    micro-batch at a time to the lane it ends soonest (ties to the earlier), which is optimal for a max
    of increasing terms; largest remainders gave equal devices unequal shares (2.55:1:1:1 at 8:
    [4, 2, 1, 1], one replica a straggler). None when ``total`` is fewer than the weights."""
    n = len(weights)
    if total < n or n == 0:
        return None
    extra = fixed or [0.0] * n
    out = [1] * n
    for _ in range(total - n):
        k = min(range(n), key=lambda i: (extra[i] + (out[i] + 1) / weights[i], i))
        out[k] += 1
    return out


@dataclass(frozen=True)
class Layout:
    """Stages (their ops) replicated in lanes: ``lanes[l][s]`` runs stage ``s`` of lane ``l``."""

    name: str
    stages: tuple[tuple[str, ...], ...]
    lanes: tuple[tuple[int, ...], ...]


def _stage_seconds(cost: CostModel, nodes: tuple[str, ...] | list[str], worker: int) -> float:
    d = cost.hw.devices[worker]
    return cost.mean_compute_seconds(nodes, d, False) + cost.mean_compute_seconds(nodes, d, True)


def lane_rates(cost: CostModel, layout: Layout) -> list[float]:
    """Micro-batches per second of each lane at ``cost``'s micro-batch size (its slowest stage's pace)."""
    return [1.0 / max(_stage_seconds(cost, nodes, w) for nodes, w in zip(layout.stages, lane, strict=True)) for lane in layout.lanes]


def layouts(cost: CostModel, req: Request) -> list[Layout]:
    """The data-parallel layouts of a cluster (module docstring)."""
    graph, hw = cost.graph, cost.hw
    ops = tuple(n.id for n in graph.compute_nodes)
    small = cost.scaled(micro_batch_scale(graph, req, req.batch_size))  # one row a micro-batch: who could hold the model at all
    rate = {d.index: 1.0 / _stage_seconds(small, ops, d.index) for d in hw.devices}
    order = sorted(rate, key=lambda i: (-rate[i], i))
    fences = sorted(find_fences(hw), key=lambda f: (-sum(rate[i] for i in f), f[0]))
    hold = [i for i in order if small.stage_memory(list(ops), 1) <= hw.devices[i].memory]
    out = [Layout(f"data parallel on the {k} fastest", (ops,), tuple((i,) for i in hold[:k])) for k in range(min(len(hold), MAX_LANES), 0, -1)]
    for j in range(1, len(fences)):
        ids = [i for i in hold if any(i in f for f in fences[:j])][:MAX_LANES]
        if ids:
            out.append(Layout(f"data parallel on the {j} fastest fences", (ops,), tuple((i,) for i in ids)))
    cuts = cut_bytes(graph)
    for depth in range(2, max(len(f) for f in fences) + 1):
        lanes = [tuple(sorted(f, key=lambda i: (-rate[i], i))[k : k + depth]) for f in fences for k in range(0, len(f) - depth + 1, depth)]
        if len(lanes) < 2:
            continue
        slowest = min(lanes, key=lambda lane: (sum(rate[i] for i in lane), lane))
        split = split_chain(cost, list(ops), [Element((w,)) for w in slowest], cuts)
        if split is None or len(split) < 2:
            continue
        stages = tuple(tuple(nodes) for _, nodes in split)
        out.append(Layout(f"{len(lanes)} replicated pipelines of depth {len(stages)}", stages,
                          tuple(lane[: len(stages)] for lane in lanes[:MAX_LANES])))
    return out


def sites_of(cost: CostModel, workers: list[int], *, apart: bool = False) -> tuple[tuple[int, ...], ...]:
    """The fences' devices among ``workers``, each site led by its fastest device (its first);
    ``apart``: every device a site of its own (where even a fence's links are too slow for raw
    gradients, every device then exchanges its gradients encoded)."""
    if apart:
        return tuple((w,) for w in sorted(workers))
    ops = [n.id for n in cost.graph.compute_nodes]
    speed = {w: 1.0 / _stage_seconds(cost, ops, w) for w in workers}
    sites = [sorted((w for w in f if w in speed), key=lambda w: (-speed[w], w)) for f in find_fences(cost.hw)]
    return tuple(tuple(s) for s in sites if s)


def lane_fixed(cost: CostModel, layout: Layout, sites: tuple[tuple[int, ...], ...]) -> list[float]:
    """Per lane, the seconds a step of its slowest device beyond its micro-batches, at its quota's rate:
    AdamW and the step's own CPU, and its part of the reduce (a site's leader takes in and sends back
    every member's gradients: on random:41 it spent 15-17 ms of CPU a step more than a member)."""
    nbytes = sum(p.meta.nbytes for p in cost.graph.params.values() if p.trainable) // max(1, len(layout.stages))
    reduce = cost.site_reduce_cpu(nbytes, sites, 1.0) if len(sites) > 1 else {}  # (raw: the codec is chosen after the shares; a ring within one site is even)
    return [max((cost.optimizer_seconds(nbytes, cost.hw.devices[w]) + reduce.get(w, 0.0)) / cost.cpu_rate(cost.hw.devices[w]) for w in lane)
            for lane in layout.lanes]


def dp_plan(cost: CostModel, req: Request, layout: Layout, micro_batches: int, scheduler: str = "dp", *, apart: bool = False) -> Plan | None:
    """The layout's plan at ``micro_batches`` (None: fewer than its lanes): shares by speed, the
    reduce across sites (``apart``: every device a site, ``sites_of``) and its codec."""
    scaled = cost.scaled(micro_batch_scale(cost.graph, req, micro_batches))
    workers = [w for lane in layout.lanes for w in lane]
    sites = sites_of(cost, workers, apart=apart)
    shares = apportion(lane_rates(scaled, layout), micro_batches, lane_fixed(cost, layout, sites))
    if shares is None:
        return None
    stages = [StagePlan(s, list(nodes), [lane[s] for lane in layout.lanes], list(shares) if len(layout.lanes) > 1 else None)
              for s, nodes in enumerate(layout.stages)]
    plan = Plan(stages, "1f1b", micro_batches, {"scheduler": scheduler, "kind": "data-parallel", "layout": layout.name})
    if len(sites) > 1:
        plan.reduce = ReducePlan(sites)
    return with_reduce_codec(plan, cost, req)


def estimate(plan: Plan, cost: CostModel, req: Request) -> float:
    """Closed-form step time of a data-parallel plan: the slowest lane's share (one micro-batch through
    its stages, the rest at its slowest stage's pace), the reduce not hidden behind the last backward
    (``CostModel.site_reduce_seconds``; the ring within one site), the optimizer; never less than a
    worker's CPU in the step (its share, its reduce, its optimizer) at its quota's rate."""
    scaled = cost.scaled(micro_batch_scale(cost.graph, req, plan.micro_batches))
    first = plan.stages[0]
    shares = first.shares or [len(plan.mbs_of(w)) for w in first.workers]
    compute = 0.0
    busy: dict[int, float] = {}  # each worker's CPU in a step at its quota's rate: what a run of steps sustains
    for lane, share in enumerate(shares):
        times = [_stage_seconds(scaled, s.nodes, s.workers[lane]) for s in plan.stages]
        compute = max(compute, sum(times) + (share - 1) * max(times))
        for s, t in zip(plan.stages, times, strict=True):
            busy[s.workers[lane]] = busy.get(s.workers[lane], 0.0) + share * t
    ratio = byte_ratio(parse_codec(plan.reduce.codec)) if plan.reduce is not None else 1.0
    exposed, seen = 0.0, set()
    for entries in shared_groups(cost.graph, plan).values():
        for group, _, nbytes in entries:
            if group in seen:
                continue
            seen.add(group)
            if plan.reduce is None:  # the ring: each round's transfer, and its two message ends on the slowest CPU
                slowest = min(cost.cpu_rate(cost.hw.devices[w]) for w in group)
                exposed += 2 * (len(group) - 1) * (cost.allreduce_round_seconds(nbytes, list(group))
                                                   + 2 * cost.message_cpu_seconds(nbytes / len(group)) / slowest)
                continue
            seconds, codec = cost.site_reduce_seconds(nbytes, leader_groups(plan, group), ratio)
            for w, spent in cost.site_reduce_cpu(nbytes, leader_groups(plan, group), ratio).items():
                busy[w] = busy.get(w, 0.0) + spent / cost.cpu_rate(cost.hw.devices[w])
            last = max(scaled.mean_compute_seconds(plan.stage_of_worker(w).nodes, cost.hw.devices[w], True) for w in group)
            exposed += max(codec, seconds - last)
    optimizer = {w: cost.optimizer_seconds(sum(cost.graph.params[p].meta.nbytes for p in plan.stage_params(cost.graph, s.index)), cost.hw.devices[w])
                 for s in plan.stages for w in s.workers}
    sustained = max(busy.get(w, 0.0) + t / cost.cpu_rate(cost.hw.devices[w]) for w, t in optimizer.items())
    return max(compute + exposed + max(optimizer.values()), sustained) + cost.step_overhead_s


def data_parallel(cost: CostModel, req: Request, *, evaluate: Evaluate | None = None, candidates: int = DP_CANDIDATES,
                  scheduler: str = "dp") -> Plan:
    """The data-parallel plan with the most predicted goodput (step time over ``reduce_efficiency``):
    every layout at every micro-batch count that divides the batch (from its lanes to 16 or four
    times its lanes) ranked by ``estimate``, the best ``candidates`` judged by ``evaluate`` (the
    simulator; without it the validator and ``estimate``). ``plan.meta`` records the prediction."""
    divisors = [m for m in range(1, req.batch_size + 1) if req.batch_size % m == 0]
    ranked: list[tuple[float, int, int, Plan]] = []
    for order, layout in enumerate(layouts(cost, req)):
        lanes = len(layout.lanes)
        split_sites = len(sites_of(cost, [w for lane in layout.lanes for w in lane])) < lanes  # a fence holds several replicas
        for m in (m for m in divisors if lanes <= m <= max(16, 4 * lanes, len(layout.stages))):
            for apart in (False, True) if split_sites else (False,):
                plan = dp_plan(cost, req, layout, m, scheduler, apart=apart)
                if apart and plan is not None and (plan.reduce is None or plan.reduce.codec == "none"):
                    continue  # raw sums inside a fence: the default reducers (a ring, a torch world) do it with fewer bytes
                if plan is not None:
                    if apart:
                        plan.meta["layout"] += ", every device its own site"
                    ranked.append((estimate(plan, cost, req) / reduce_efficiency(plan.reduce.codec if plan.reduce else "none"), order, m, plan))
    ranked.sort(key=lambda x: x[:3])
    best: tuple[float, Plan] | None = None
    judged, invalid = 0, 0
    for _, _, _, plan in ranked:
        try:
            if evaluate is None:
                validate_plan(cost.graph, plan, cost, req)
                t = estimate(plan, cost, req)
            else:
                t = evaluate(plan, cost, req)
        except InvalidPlan:
            invalid += 1
            continue
        judged += 1
        eff = reduce_efficiency(plan.reduce.codec if plan.reduce else "none")
        if best is None or t / eff < best[0]:
            plan.meta.update({"predicted_step_s": t, "efficiency": eff, "fences": find_fences(cost.hw)})
            best = (t / eff, plan)
        if judged >= candidates:
            break
    if best is None:
        raise ConfigError("no data-parallel plan fits: no device holds the model, and no replicated pipeline fits the fences")
    best[1].meta["candidates"] = {"ranked": len(ranked), "judged": judged, "invalid": invalid}
    return best[1]


def weigh(pipeline: Plan, cost: CostModel, req: Request, *, evaluate: Evaluate, candidates: int = DP_CANDIDATES) -> Plan:
    """OP-Fence's ``pipeline`` or the best data-parallel plan (``candidates`` of them judged), whichever
    has the more predicted goodput (a tie: the pipeline); both predictions go into the chosen plan's
    ``meta["weighed"]``, and the search's counts into ``meta["candidates"]`` (the pipelines', with
    the data-parallel ones under ``data_parallel``)."""
    try:
        dp = data_parallel(cost, req, evaluate=evaluate, candidates=candidates, scheduler=str(pipeline.meta.get("scheduler", "opfence")))
    except ConfigError:
        return pipeline
    t_pipe, t_dp, eff = evaluate(pipeline, cost, req), float(dp.meta["predicted_step_s"]), float(dp.meta["efficiency"])
    weighed = {"pipeline": {"tokens_per_s": req.tokens / t_pipe, "efficiency": 1.0, "layout": pipeline.meta.get("layout")},
               "data-parallel": {"tokens_per_s": req.tokens / t_dp, "efficiency": eff, "layout": dp.meta.get("layout"),
                                 "codec": dp.reduce.codec if dp.reduce else "none"}}
    counts = {**pipeline.meta.get("candidates", {}), "data_parallel": dp.meta["candidates"]}
    chosen = dp if t_dp / eff < t_pipe else pipeline
    chosen.meta.update({"weighed": weighed, "candidates": counts})
    return chosen
