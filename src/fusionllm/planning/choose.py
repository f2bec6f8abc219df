"""From hardware to a synchronous Plan: the cost model, the scheduler's search under the placement
constraint, the codec's prediction; the hardware of a cluster file, and links re-measured slower."""

from __future__ import annotations

import time
from collections.abc import Callable

from fusionllm.cluster.hardware import Hardware
from fusionllm.cluster.spec import load_cluster
from fusionllm.compress.codecs import parse_codec
from fusionllm.core.errors import ConfigError, FusionError
from fusionllm.cost.model import CostModel
from fusionllm.cost.work import OpWork
from fusionllm.graph.ir import OpGraph
from fusionllm.planning.adatopk import compression_aware, with_compression
from fusionllm.planning.predict import predict
from fusionllm.planning.schedulers import make_schedule
from fusionllm.schedule.plan import Plan, Request
from fusionllm.schedule.validate import InvalidPlan
from fusionllm.sim.simulator import simulate


def hardware_from_file(path: str, workers: int) -> Hardware:
    hw = Hardware.from_spec(load_cluster(path))
    if len(hw) != workers:
        raise ConfigError(f"--hardware {path} describes {len(hw)} devices, the run has {workers} workers")
    return hw


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
    codec = parse_codec(compress)
    if codec.adaptive and scheduler == "opfence":
        plan, judged = compression_aware(plan, cost, req)
    elif not codec.lossless:
        judged = with_compression(plan, cost, req, compress)  # the prediction counts the codec too
    predicted = simulate(plan, judged, req)
    plan.meta.update({"predicted_step_s": predicted.step_time_s, "predicted_tokens_per_s": predicted.tokens_per_s})
    say(f"scheduler {scheduler}: {len(plan.stages)} stages on {len(plan.workers)} of {len(hw)} workers, "
        f"{plan.micro_batches} micro-batches, predicted {predicted.step_time_s:.3f} s/step "
        f"({predicted.tokens_per_s:.0f} tokens/s){_data_parallel(plan)} [{time.perf_counter() - started:.1f} s to plan]")
    return plan, cost


def _data_parallel(plan: Plan) -> str:
    """What a data-parallel plan adds to the planner's line: shares, sites (leaders first), codec."""
    if plan.meta.get("kind") != "data-parallel":
        return ""
    shares = "; ".join(f"stage {s.index} {s.workers} shares {s.shares}" for s in plan.stages if s.shares)
    reduce = (f", reduce across sites {' '.join('(' + ','.join(map(str, x)) + ')' for x in plan.reduce.sites)} with {plan.reduce.codec}"
              if plan.reduce else "")
    return f", data parallel: {shares or 'one replica'}{reduce} at {float(plan.meta.get('efficiency', 1.0)):.2f} per-token efficiency"


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
