"""AdaTopK's budget for the replicas' reduce: the codec of the site leaders' exchange.

A data-parallel plan sums its replicas' gradients every step (``Plan.reduce``): raw within each site
of fast links, encoded between the sites' leaders. The exchange overlaps the last backward of the
step (buckets go out as their gradients become final), so the budget is that backward's time: the
codec is ``none`` where the raw sum fits (fast links); else the measured codec
(``efficiency.REDUCE_EFFICIENCY``) with the most per-token efficiency per second of step it adds
beyond the budget: efficiency x budget / max(budget, its exchange). The planner weighs the plan with
that efficiency and the exchange that is not hidden (``planning/data_parallel.py``).
"""

from __future__ import annotations

from dataclasses import replace

from fusionllm.compress.codecs import byte_ratio, parse_codec
from fusionllm.cost.model import CostModel
from fusionllm.planning.efficiency import REDUCE_EFFICIENCY
from fusionllm.schedule.plan import Plan, Request, micro_batch_scale, shared_groups


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
    """The codec of the leaders' exchange (module docstring): ``none``, or a measured lossy codec."""
    if plan.reduce is None:
        return "none"
    need = min((budget / raw for raw, budget in reduce_budgets(plan, cost, req) if raw > 0), default=1.0)
    if need >= 1.0:
        return "none"

    def worth(item: tuple[str, float]) -> float:  # efficiency per unit of step, the exchange's excess over the budget counted
        codec, eff = item
        return eff * need / max(need, byte_ratio(parse_codec(codec)))

    candidates = [("none", 1.0), *REDUCE_EFFICIENCY.items()]
    return max(candidates, key=worth)[0]


def with_reduce_codec(plan: Plan, cost: CostModel, req: Request) -> Plan:
    """``plan`` with its reduce's codec chosen by the budget (unchanged without a reduce)."""
    if plan.reduce is not None:
        plan.reduce = replace(plan.reduce, codec=reduce_codec(plan, cost, req))
    return plan
