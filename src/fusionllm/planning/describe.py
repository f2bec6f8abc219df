"""What `fusionllm plan --json` prints about a plan: stages (replicas' shares), the reduce across sites, links, the prediction and its bottleneck,
groups, H and codecs of a hierarchical plan, and the utilization of every device."""

from __future__ import annotations

import json
from typing import Any

from fusionllm.cost.model import CostModel
from fusionllm.planning.fences import find_fences
from fusionllm.schedule.hierarchy import HierPlan
from fusionllm.schedule.plan import Plan, Request, micro_batch_scale, routes
from fusionllm.schedule.validate import programs, worker_memory
from fusionllm.sim.rounds import simulate_rounds
from fusionllm.sim.simulator import simulate
from fusionllm.sim.utilization import sync_utilization


def describe(plan: Plan, cost: CostModel, req: Request) -> dict[str, Any]:
    """What `fusionllm plan --json` prints: fences, stages, links, prediction, bottleneck."""
    result = simulate(plan, cost, req)
    scaled = cost.scaled(micro_batch_scale(cost.graph, req, plan.micro_batches))
    graph = cost.graph
    r = routes(graph, plan)
    stages = []
    memory = worker_memory(plan, programs(graph, plan), cost, req)
    for s in plan.stages:
        names = plan.stage_params(graph, s.index)
        stages.append({
            "stage": s.index, "workers": s.workers, "shares": s.shares, "ops": len(s.nodes),
            "first_op": graph.node(s.nodes[0]).name, "last_op": graph.node(s.nodes[-1]).name,
            "params": sum(graph.params[p].meta.numel for p in names),
            "memory_bytes": max(memory[w] for w in s.workers),
            "sends_bytes_per_micro_batch": sum(scaled.edge_bytes(graph.edges()[e].meta.nbytes) for e in r.leaving[s.index]),
        })
    busiest_dev = max(result.busy_s.items(), key=lambda kv: kv[1]) if result.busy_s else (None, 0.0)
    busiest_link = max(result.link_busy_s.items(), key=lambda kv: kv[1]) if result.link_busy_s else (None, 0.0)
    if busiest_link[1] > busiest_dev[1]:
        bottleneck = f"link {busiest_link[0]}: busy {busiest_link[1]:.3f} s of {result.step_time_s:.3f} s"
    else:
        bottleneck = f"device w{busiest_dev[0]}: computing {busiest_dev[1]:.3f} s of {result.step_time_s:.3f} s"
    return {
        "scheduler": plan.meta.get("scheduler"), "layout": plan.meta.get("layout"),
        "fences": find_fences(cost.hw), "schedule": plan.schedule, "micro_batches": plan.micro_batches,
        "kind": plan.meta.get("kind", "pipeline"), "reduce": plan.reduce.to_obj() if plan.reduce else None,
        "efficiency": plan.meta.get("efficiency", 1.0), "weighed": plan.meta.get("weighed"),
        "stages": stages,
        "links": {f"w{a}->w{b}": {"codec": "raw", "ratio": cost.ratio(a, b), "bandwidth_bps": cost.hw.bps(a, b)}
                  for a in plan.workers for b in plan.workers if a != b and f"w{a}->w{b}" in result.link_bytes},
        "unused_devices": sorted(set(range(len(cost.hw))) - set(plan.workers)),
        "candidates": plan.meta.get("candidates"),
        "predicted": result.to_json(),
        "bottleneck": bottleneck,
        "plan": json.loads(plan.to_json()),
    }


def describe_hier(hier: HierPlan, cost: CostModel, req: Request) -> dict[str, Any]:
    """What `fusionllm plan --sync hierarchical --json` prints: groups, H, fragments, codecs, the
    predicted round and the utilization of every device."""
    graph = cost.graph
    req = hier.request(req)  # one inner step of one group
    result = simulate_rounds(hier, cost, req)
    groups = []
    for g, step_s, wait in zip(hier.groups, result.step_s, result.waits_s, strict=True):
        groups.append({
            "group": g.index, "workers": g.workers, "stages": [s.workers for s in g.plan.stages],
            "micro_batches": g.plan.micro_batches, "inner_steps": g.inner_steps, "step_s": step_s,
            "waits_s_per_round": wait, "tokens_per_round": g.inner_steps * req.tokens,
        })
    frag_sizes = [sum(graph.params[n].meta.numel for n in f) for f in hier.fragments]
    return {
        "sync": "hierarchical", "grouping": hier.meta.get("grouping"), "fences": find_fences(cost.hw), "groups": groups,
        "fragments": len(hier.fragments), "fragment_params": frag_sizes, "codec": hier.codec, "link_codecs": hier.link_codecs,
        "outer_lr": hier.outer_lr, "outer_momentum": hier.outer_momentum, "overlap": hier.overlap, "group_batch": req.batch_size,
        "efficiency": hier.meta.get("efficiency"), "goodput": hier.meta.get("goodput"),
        "unused_devices": sorted(set(range(len(cost.hw))) - set(hier.workers)),
        "utilization": result.utilization, "device_utilization": {str(k): v for k, v in result.device_busy.items()},
        "predicted": result.to_json(), "traffic_hidden": hier.meta.get("traffic_hidden"),
        "synchronous": hier.meta.get("synchronous"), "candidates": hier.meta.get("candidates"),
        "outer_codec_choice": hier.meta.get("outer_codec_choice"),  # per H tried: the codec chosen, its efficiency and goodput
        "plan": json.loads(hier.to_json()),
    }


def sync_report(plan: Plan, cost: CostModel, req: Request) -> dict[str, Any]:
    """A synchronous plan's utilization and every device's busy fraction (for `plan --json`)."""
    r = simulate(plan, cost, req)
    util, frac = sync_utilization(plan, cost, r.busy_s, r.step_time_s)
    return {"utilization": util, "device_utilization": {str(k): v for k, v in frac.items()}}
