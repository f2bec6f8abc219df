"""AdaTopK's budget for the replicas' reduce: the codec of the site leaders' exchange.

A data-parallel plan sums its replicas' gradients every step (``Plan.reduce``): raw within each site
of fast links, encoded between the sites' leaders. The exchange overlaps the last backward of the
step (buckets go out as their gradients become final), so the budget is that backward's time: the
codec is the least lossy one whose exchange over the slowest leader link fits in it. ``none`` where
the raw sum fits (fast links); else error-fed top-k at the largest ratio that fits, never below
``MIN_REDUCE_RATIO``: a plan that needs more than that pays the rest in its step time, and the
planner weighs it as such (``planning/data_parallel.py``).
"""

from __future__ import annotations

from dataclasses import replace

from fusionllm.compress.codecs import byte_ratio, parse_codec
from fusionllm.cost.model import CostModel
from fusionllm.schedule.plan import Plan, Request, micro_batch_scale, shared_groups

# top-k ratios the reduce may use, least lossy first (topk: fp16 values and compact positions, about
# 1/R fewer bytes); the last is the floor: past about 100x the error-fed gradient loses more per
# token than the field reports keeping (DGC, PowerSGD: on par with SGD at 100x and beyond)
REDUCE_RATIOS = (0.5, 0.25, 0.1, 0.05, 0.02, 0.01)
MIN_REDUCE_RATIO = REDUCE_RATIOS[-1]


def leader_groups(plan: Plan, group: tuple[int, ...]) -> list[list[int]]:
    """``plan.reduce``'s sites restricted to ``group`` (each led by its first listed member of the group)."""
    assert plan.reduce is not None
    return [members for site in plan.reduce.sites if (members := [w for w in site if w in group])]


def reduce_budgets(plan: Plan, cost: CostModel, req: Request) -> list[tuple[float, float]]:
    """For each reduce group of a plan with ``reduce`` (replicas, tied weights) whose sites are more
    than one: the seconds its leaders' raw exchange takes over the slowest leader link, and the budget
    it hides behind (the last backward: one micro-batch's, on the group's slowest member)."""
    assert plan.reduce is not None
    scaled = cost.scaled(micro_batch_scale(cost.graph, req, plan.micro_batches))
    out, seen = [], set()
    for entries in shared_groups(cost.graph, plan).values():
        for group, _, nbytes in entries:
            sites = leader_groups(plan, group)
            if group in seen or len(sites) < 2:
                continue
            seen.add(group)
            leaders = [s[0] for s in sites]
            raw = max(cost.transfer_seconds(nbytes, a, b, raw=True) + cost.latency(a, b) for a in leaders for b in leaders if a != b)
            budget = max(scaled.mean_compute_seconds(plan.stage_of_worker(w).nodes, cost.hw.devices[w], True) for w in group)
            out.append((raw, budget))
    return out


def reduce_codec(plan: Plan, cost: CostModel, req: Request) -> str:
    """The codec of the leaders' exchange (module docstring): ``none``, or ``topk:R``."""
    if plan.reduce is None:
        return "none"
    need = min((budget / raw for raw, budget in reduce_budgets(plan, cost, req) if raw > 0), default=1.0)
    if need >= 1.0:
        return "none"
    fits = [r for r in REDUCE_RATIOS if byte_ratio(parse_codec(f"topk:{r}")) <= need]
    return f"topk:{fits[0] if fits else MIN_REDUCE_RATIO:g}"


def with_reduce_codec(plan: Plan, cost: CostModel, req: Request) -> Plan:
    """``plan`` with its reduce's codec chosen by the budget (unchanged without a reduce)."""
    if plan.reduce is not None:
        plan.reduce = replace(plan.reduce, codec=reduce_codec(plan, cost, req))
    return plan
