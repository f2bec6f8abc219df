"""From joined workers to a Plan: hardware (probed or from a cluster file), cost model, scheduler."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Any

from fusionllm.cluster.hardware import DEFAULT_CPU_MEMORY, Device, Hardware
from fusionllm.cluster.spec import load_cluster
from fusionllm.control.adatopk import (  # noqa: F401 (AdaTopK in planning; re-exported here)
    ADATOPK_PLAN_RATIO,
    COMPRESSED_PLAN_GAIN,
    adatopk_policy,
    compression_aware,
    link_policy,
    with_compression,
)
from fusionllm.control.reach import routes
from fusionllm.core.errors import ConfigError, FusionError
from fusionllm.cost.model import CostModel
from fusionllm.cost.work import OpWork
from fusionllm.graph.ir import OpGraph
from fusionllm.schedule.plan import Plan, Request
from fusionllm.schedule.schedulers import make_schedule
from fusionllm.schedule.validate import InvalidPlan
from fusionllm.sim.simulator import simulate
from fusionllm.transport.rpc import RpcClient


def predict(plan: Plan, cost: CostModel, req: Request) -> float:
    """The simulator's step time: how OP-Fence compares its candidates."""
    return simulate(plan, cost, req).step_time_s


def hardware_from_file(path: str, workers: int) -> Hardware:
    hw = Hardware.from_spec(load_cluster(path))
    if len(hw) != workers:
        raise ConfigError(f"--hardware {path} describes {len(hw)} devices, the run has {workers} workers")
    return hw


async def probe_hardware(members: dict[int, Any], clients: dict[int, RpcClient], *, seconds: float, say: Callable[[str], None],
                         reference_flops: float) -> Hardware:
    """Device speeds from the workers' own matmul probes (in cores of ``reference_flops``); every link
    measured through our transport."""
    ref = reference_flops
    devices = []
    for w in sorted(members):
        info = members[w].info
        dev, flops, host = info.device, info.matmul_flops or ref, info.hostname or "?"
        if dev.kind == "cuda":
            devices.append(Device(w, host, None, flops / 0.4 * 1.0, dev.memory_bytes or DEFAULT_CPU_MEMORY))
        else:
            devices.append(Device(w, host, flops / ref, None, dev.memory_bytes or DEFAULT_CPU_MEMORY))
    n = len(devices)
    bw = [[math.inf] * n for _ in range(n)]
    started = time.perf_counter()
    infos = {w: m.info for w, m in members.items()}
    for i in range(n):
        seen_from_i = routes(infos, i)[0]  # through a relay, or on the LAN between workers behind one NAT
        for j in range(n):
            if i != j:
                address = seen_from_i.get(j) or members[j].address
                reply = await clients[i].call("MeasureTo", {"address": address, "seconds": seconds}, timeout=seconds * 30 + 120)
                bw[i][j] = float(reply["bps"])
    say(f"probed {n * (n - 1)} links in {time.perf_counter() - started:.1f} s; device speeds (reference cores): "
        + ", ".join(f"w{d.index}={d.cpus:.2f}" if d.cpus else f"w{d.index}={d.flops:.3g}flop/s" for d in devices))
    return Hardware(tuple(devices), tuple(tuple(r) for r in bw), tuple(tuple(0.0 for _ in range(n)) for _ in range(n)), "probed")


def choose_plan(graph: OpGraph, hw: Hardware, scheduler: str, req: Request, *, work: dict[str, OpWork], say: Callable[[str], None],
                compress: str = "none", place: Callable[[Plan], Plan] | None = None, recompute: bool = False) -> tuple[Plan, CostModel]:
    """The scheduler's plan; with ``compress=adatopk``, OP-Fence also weighs plans that use slow links
    compressed. Returns the plan and the cost model without compression (AdaTopK's policy starts there).

    ``place`` puts a plan's stages on workers that run their op kinds (``capabilities.place``): a
    constraint of the search, so OP-Fence judges every candidate as it will run, drops those no
    placement fits, and the prediction is the placed plan's."""
    started = time.perf_counter()
    cost = CostModel(graph, work, hw, recompute=recompute)

    def judge(plan: Plan, cost: CostModel, req: Request) -> float:
        if place is not None:
            try:
                plan = place(plan)
            except FusionError as exc:
                raise InvalidPlan("capability", str(exc)) from None
        return predict(plan, cost, req)

    plan = make_schedule(scheduler, cost, req, evaluate=judge)
    if place is not None:
        plan = place(plan)
    judged = cost
    if compress == "adatopk" and scheduler == "opfence":
        plan, judged = compression_aware(plan, cost, req)
    elif compress != "none":
        judged = with_compression(plan, cost, req, compress)  # the prediction counts the codec too
    predicted = simulate(plan, judged, req)
    plan.meta.update({"predicted_step_s": predicted.step_time_s, "predicted_tokens_per_s": predicted.tokens_per_s})
    say(f"scheduler {scheduler}: {len(plan.stages)} stages on {len(plan.workers)} of {len(hw)} workers, "
        f"{plan.micro_batches} micro-batches, predicted {predicted.step_time_s:.3f} s/step "
        f"({predicted.tokens_per_s:.0f} tokens/s) [{time.perf_counter() - started:.1f} s to plan]")
    return plan, cost


def describe(plan: Plan, cost: CostModel, req: Request) -> dict[str, Any]:
    """What `fusionllm plan --json` prints: fences, stages, links, prediction, bottleneck."""
    from fusionllm.schedule.fences import find_fences
    from fusionllm.schedule.plan import micro_batch_scale, routes
    from fusionllm.schedule.validate import programs, worker_memory

    result = simulate(plan, cost, req)
    scaled = cost.scaled(micro_batch_scale(cost.graph, req, plan.micro_batches))
    graph = cost.graph
    r = routes(graph, plan)
    stages = []
    memory = worker_memory(plan, programs(graph, plan), cost, req)
    for s in plan.stages:
        names = {p for n in s.nodes for p in graph.node(n).params.values()}
        stages.append({
            "stage": s.index, "workers": s.workers, "ops": len(s.nodes),
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
        "stages": stages,
        "links": {f"w{a}->w{b}": {"codec": "raw", "ratio": cost.ratio(a, b), "bandwidth_bps": cost.hw.bps(a, b)}
                  for a in plan.workers for b in plan.workers if a != b and f"w{a}->w{b}" in result.link_bytes},
        "unused_devices": sorted(set(range(len(cost.hw))) - set(plan.workers)),
        "candidates": plan.meta.get("candidates"),
        "predicted": result.to_json(),
        "bottleneck": bottleneck,
        "plan": json.loads(plan.to_json()),
    }


def with_measured_links(hw: Hardware, measured: dict[tuple[int, int], float], *, below: float = 0.5) -> Hardware:
    """The hardware with the links measured at less than ``below`` x their planned rate set to what was measured."""
    from dataclasses import replace

    rows = [list(r) for r in hw.bandwidth]
    changed = False
    for (a, b), bps in measured.items():
        if a < len(rows) and b < len(rows) and bps < below * rows[a][b]:
            rows[a][b] = bps
            changed = True
    return replace(hw, bandwidth=tuple(tuple(r) for r in rows)) if changed else hw
