"""From joined workers to a Plan: hardware (probed or from a cluster file), cost model, scheduler."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Any

from fusionllm.cluster.hardware import DEFAULT_CPU_MEMORY, Device, Hardware
from fusionllm.cluster.spec import load_cluster
from fusionllm.compress.policy import LinkPolicy
from fusionllm.core.errors import ConfigError
from fusionllm.cost.model import CostModel
from fusionllm.graph.ir import OpGraph
from fusionllm.graph.registry import SourceProvider
from fusionllm.runtime.profile import estimate, matmul_flops
from fusionllm.schedule.plan import Plan, Request
from fusionllm.schedule.schedulers import make_schedule
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


async def probe_hardware(members: dict[int, Any], clients: dict[int, RpcClient], *, seconds: float, say: Callable[[str], None]) -> Hardware:
    """Device speeds from the workers' own matmul probes; every link measured through our transport."""
    ref = matmul_flops("cpu", threads=1, seconds=0.5)
    devices = []
    for w in sorted(members):
        info = members[w].info
        dev = info.get("device", {})
        flops = float(info.get("probe", {}).get("matmul_flops", ref))
        if dev.get("kind") == "cuda":
            devices.append(Device(w, info.get("hostname", "?"), None, flops / 0.4 * 1.0, int(dev.get("memory_bytes", DEFAULT_CPU_MEMORY))))
        else:
            devices.append(Device(w, info.get("hostname", "?"), flops / ref, None, int(dev.get("memory_bytes", DEFAULT_CPU_MEMORY))))
    n = len(devices)
    bw = [[math.inf] * n for _ in range(n)]
    started = time.perf_counter()
    for i in range(n):
        for j in range(n):
            if i != j:
                reply = await clients[i].call("MeasureTo", {"address": members[j].address, "seconds": seconds}, timeout=seconds * 30 + 120)
                bw[i][j] = float(reply["bps"])
    say(f"probed {n * (n - 1)} links in {time.perf_counter() - started:.1f} s; device speeds (reference cores): "
        + ", ".join(f"w{d.index}={d.cpus:.2f}" if d.cpus else f"w{d.index}={d.flops:.3g}flop/s" for d in devices))
    return Hardware(tuple(devices), tuple(tuple(r) for r in bw), tuple(tuple(0.0 for _ in range(n)) for _ in range(n)), "probed")


def choose_plan(graph: OpGraph, hw: Hardware, scheduler: str, req: Request, *, source: SourceProvider | None, say: Callable[[str], None],
                compress: str = "none") -> tuple[Plan, CostModel]:
    """The scheduler's plan; with ``compress=adatopk``, OP-Fence also weighs plans that use slow links
    compressed. Returns the plan and the cost model without compression (AdaTopK's policy starts there)."""
    started = time.perf_counter()
    work = estimate(graph, source=source, calibrate=True)
    cost = CostModel(graph, work, hw)
    plan = make_schedule(scheduler, cost, req, evaluate=predict)
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


def offline(model: str, cluster_file: str, scheduler: str, req: Request, *, vocab_size: int = 256) -> tuple[OpGraph, Hardware, CostModel, Plan]:
    """Plan a model for a cluster file without any worker (what `fusionllm plan` / `simulate` do).

    The model is traced on the meta device. Ops are timed on this machine when the cluster has CPU
    devices (their speed is a quota of this machine's cores); accelerators use counted FLOPs.
    """
    from fusionllm.models.spec import build_model
    from fusionllm.runtime.model_graph import spec_source, trace_lm

    hw = Hardware.from_spec(load_cluster(cluster_file))
    net = build_model(model, vocab_size, device="meta")
    if req.batch_size % req.micro_batches:
        raise ConfigError(f"--batch-size {req.batch_size} must be a multiple of --micro-batches {req.micro_batches}")
    graph = trace_lm(net, req.batch_size // req.micro_batches, req.seq_len, vocab_size=vocab_size, spec=model)
    calibrate = any(d.cpus for d in hw.devices)
    work = estimate(graph, source=spec_source(model, vocab_size), calibrate=calibrate)
    cost = CostModel(graph, work, hw)
    return graph, hw, cost, make_schedule(scheduler, cost, req, evaluate=predict)


def describe(plan: Plan, cost: CostModel, req: Request) -> dict[str, Any]:
    """What `fusionllm plan --json` prints: fences, stages, links, prediction, bottleneck."""
    from fusionllm.schedule.fences import find_fences
    from fusionllm.schedule.plan import micro_batch_scale, routes

    result = simulate(plan, cost, req)
    scaled = cost.scaled(micro_batch_scale(cost.graph, req, plan.micro_batches))
    graph = cost.graph
    r = routes(graph, plan)
    stages = []
    for i, s in enumerate(plan.stages):
        names = {p for n in s.nodes for p in graph.node(n).params.values()}
        in_flight = plan.micro_batches if plan.schedule == "gpipe" else min(plan.micro_batches, len(plan.stages) - i)
        stages.append({
            "stage": s.index, "workers": s.workers, "ops": len(s.nodes),
            "first_op": graph.node(s.nodes[0]).name, "last_op": graph.node(s.nodes[-1]).name,
            "params": sum(graph.params[p].meta.numel for p in names),
            "memory_bytes": scaled.stage_memory(s.nodes, in_flight),
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
        "predicted": result.to_json(),
        "bottleneck": bottleneck,
        "plan": json.loads(plan.to_json()),
    }


ADATOPK_PLAN_RATIO = 0.09  # the byte ratio AdaTopK reached with no measurable loss (docs/compression.md)
COMPRESSED_PLAN_GAIN = 0.8  # a plan that relies on compression replaces the plain one only if predicted this much faster


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


def compression_aware(plan: Plan, cost: CostModel, req: Request) -> tuple[Plan, CostModel]:
    """OP-Fence again, on links that AdaTopK would compress: a link too slow for the budget (the
    uncompressed plan's stage time, shortened as if every device took part) carries its bytes x
    max(ADATOPK_PLAN_RATIO, what fits the budget). The plan found
    there replaces the plain one only when predicted clearly faster (both judged with compression);
    also returns the cost model it was judged with."""
    from dataclasses import replace

    policy = link_policy(plan, cost, req)
    act = max(policy.bytes_per_mb.values(), default=0.0) or max(e.meta.nbytes for e in cost.graph.edges().values())
    # a plan on every device has stages this much shorter than the uncompressed plan's
    budget = policy.budget_s * len(set(plan.workers)) / len(cost.hw)
    ratios = {}
    for a in range(len(cost.hw)):
        for b in range(len(cost.hw)):
            bps = cost.hw.bps(a, b)
            if a == b or not math.isfinite(bps):
                continue
            seconds = act * 8 / bps
            if seconds > budget > 0:
                ratios[(a, b)] = max(ADATOPK_PLAN_RATIO, 0.8 * budget / seconds)
    squeezed = replace(cost, ratios=ratios)
    again = make_schedule("opfence", squeezed, req, evaluate=predict)
    # the compressed plan must win clearly: on three-sites a 2% predicted gain measured 20% slower
    if predict(again, squeezed, req) < COMPRESSED_PLAN_GAIN * predict(plan, squeezed, req):
        return again, squeezed
    return plan, squeezed


def link_policy(plan: Plan, cost: CostModel, req: Request) -> LinkPolicy:
    """AdaTopK's starting point: per worker link, the bytes one micro-batch sends and the link's rate;
    the budget is the slowest stage's compute per micro-batch."""
    from fusionllm.schedule.plan import micro_batch_scale, routes

    scaled = cost.scaled(micro_batch_scale(cost.graph, req, plan.micro_batches))
    graph = cost.graph
    edges = graph.edges()
    r = routes(graph, plan)
    budget = 0.0
    for s in plan.stages:
        for w in s.workers:
            d = cost.hw.devices[w]
            budget = max(budget, scaled.mean_compute_seconds(s.nodes, d, False) + scaled.mean_compute_seconds(s.nodes, d, True))
    policy = LinkPolicy(budget_s=budget)
    seen: set[tuple] = set()
    for e, consumers in r.consumers.items():
        if r.producer[e] < 0 or not edges[e].requires_grad:
            continue
        nbytes = scaled.edge_bytes(edges[e].meta.nbytes)
        for c in consumers:
            for mb in range(plan.micro_batches):
                a, b = plan.worker_for(r.producer[e], mb), plan.worker_for(c, mb)
                for link in ((a, b), (b, a)):  # activations forward, their gradients back
                    if (e, c, link) in seen:
                        continue
                    seen.add((e, c, link))
                    policy.bytes_per_mb[link] = policy.bytes_per_mb.get(link, 0.0) + nbytes
                    policy.bps.setdefault(link, cost.hw.bps(*link))
    return policy


def with_compression(plan: Plan, cost: CostModel, req: Request, compress: str) -> CostModel:
    """The cost model with each link's byte ratio under a codec (what `simulate --compress` uses)."""
    from dataclasses import replace

    from fusionllm.compress.codecs import byte_ratio, parse_codec

    spec = parse_codec(compress)
    if spec.kind == "none":
        return cost
    n = len(cost.hw)
    if spec.kind == "adatopk":
        policy = link_policy(plan, cost, req)
        ratios = {link: policy.byte_target(link) for link in policy.bytes_per_mb}
    else:
        ratios = {(a, b): byte_ratio(spec) for a in range(n) for b in range(n) if a != b}
    return replace(cost, ratios=ratios)
