"""Random planning cases and what must hold for each: the property tests and ``experiments/plan_fuzz.py``.

A case is a random cluster file (``fusionllm.cluster.random``), a model, a scheduler, a pipeline
schedule, a codec, a batch and a micro-batch count. For each, planning must end in one of two ways:

- a plan that the validator accepts (``schedule.validate``: every message matched, no cycle,
  every micro-batch once per stage, memory within every device), that the simulator runs to the
  end with a finite step time, and, from OP-Fence, that makes sense: a stage without trainable
  parameters only on the slowest device of the plan, never on a faster one;
- or a one-line "does not fit" error (the model is too large for the devices).

Anything else (a deadlock, an invalid plan, another exception) is a failure, reported with the
case so that it can be replayed: ``run_case(case)`` is a pure function of the case.
"""

from __future__ import annotations

import functools
import math
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

from fusionllm.cluster.hardware import Hardware
from fusionllm.cluster.random import ClusterShape, random_cluster
from fusionllm.core.errors import ConfigError
from fusionllm.cost.model import CostModel
from fusionllm.graph.ir import OpGraph
from fusionllm.planning.schedulers import (
    DEFAULT_CANDIDATES,
    SCHEDULERS,
    device_speed,
    has_params,
    make_schedule,
)
from fusionllm.schedule.plan import Plan, Request
from fusionllm.schedule.validate import InvalidPlan, programs, validate_plan, worker_memory
from fusionllm.sim.simulator import simulate

BUILTIN_MODELS = ("gpt-nano", "gpt-micro", "gpt-mini", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
ZOO_MODELS = ("tests.zoo:dense", "tests.zoo:skip_tied")  # unusual wiring: dense skip edges, tied weights
CODECS = ("none", "fp16", "eq:0.7", "topk:0.1", "adatopk")
SEQ_LEN = {"gpt-nano": 64, "tests.zoo:skip_tied": 64, "gpt2": 512, "gpt2-medium": 512, "gpt2-large": 512, "gpt2-xl": 1024}  # others: 128


@dataclass(frozen=True)
class Case:
    cluster_seed: int
    kind: str  # "gpu" or "cpu" devices
    sites: tuple[int, int]
    devices: tuple[int, int]
    model: str
    scheduler: str
    schedule: str
    compress: str
    batch_size: int
    micro_batches: int
    candidates: int = DEFAULT_CANDIDATES


@dataclass
class Outcome:
    case: Case
    verdict: str  # "planned", "does not fit", or "FAILED"
    message: str = ""
    devices: int = 0
    devices_used: int = 0
    stages: int = 0
    step_s: float = math.nan
    plan_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.verdict != "FAILED"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "case": asdict(self.case)}


def draw_case(rng: random.Random, models: tuple[str, ...] = BUILTIN_MODELS + ZOO_MODELS, *, max_devices: int = 64, candidates: int = DEFAULT_CANDIDATES) -> Case:
    """One case, from the ranges of issue 14: 2-10 sites, 2-64 devices, every scheduler and schedule."""
    batch = rng.choice([4, 8, 16, 32, 64])
    return Case(
        cluster_seed=rng.randrange(10**9),
        kind=rng.choice(["gpu", "gpu", "cpu"]),
        sites=(2, 10),
        devices=(2, max_devices),
        model=rng.choice(models),
        scheduler=rng.choice(SCHEDULERS),
        schedule=rng.choice(["1f1b", "gpipe"]),
        compress=rng.choice(CODECS),
        batch_size=batch,
        micro_batches=rng.choice([m for m in (1, 2, 4, 8) if batch % m == 0]),
        candidates=candidates,
    )


@functools.cache
def model_cost_inputs(model: str) -> tuple[OpGraph, dict]:
    """The model traced on meta (one sequence per micro-batch: plans scale it) and its counted work."""
    from fusionllm.models.spec import build_model
    from fusionllm.runtime.backends.model_graph import spec_source, trace_lm
    from fusionllm.runtime.backends.profile import estimate

    graph = trace_lm(build_model(model, 256, device="meta"), 1, SEQ_LEN.get(model, 128), vocab_size=256, spec=model)
    return graph, estimate(graph, source=spec_source(model, 256), calibrate=False)


def run_case(case: Case) -> Outcome:
    from fusionllm.planning.adatopk import compression_aware, with_compression
    from fusionllm.planning.predict import predict

    graph, work = model_cost_inputs(case.model)
    hw = Hardware.from_spec(random_cluster(case.cluster_seed, ClusterShape(sites=case.sites, devices=case.devices, kind=case.kind)))
    cost = CostModel(graph, work, hw)
    req = Request(case.batch_size, SEQ_LEN.get(case.model, 128), case.micro_batches, case.schedule)
    out = Outcome(case, "FAILED", devices=len(hw))
    started = time.perf_counter()
    try:
        plan = make_schedule(case.scheduler, cost, req, evaluate=predict, candidates=case.candidates)
        judged = cost
        if case.compress == "adatopk" and case.scheduler == "opfence":
            plan, judged = compression_aware(plan, cost, req)
        judged = with_compression(plan, judged if case.compress == "adatopk" else cost, req, case.compress)
    except ConfigError as exc:
        out.plan_s = time.perf_counter() - started
        if "fit" in str(exc):
            out.verdict, out.message = "does not fit", str(exc)
        else:
            out.message = f"planning failed: {exc}"
        return out
    except Exception as exc:  # noqa: BLE001 - a fuzzer reports every crash with its case
        out.plan_s = time.perf_counter() - started
        out.message = f"planning crashed: {type(exc).__name__}: {exc}"
        return out
    out.plan_s = time.perf_counter() - started
    out.devices_used, out.stages = len(plan.workers), len(plan.stages)
    problem = check_plan(plan, judged, req)
    if problem:
        out.message = problem
        return out
    out.step_s = simulate(plan, judged, req).step_time_s
    out.verdict = "planned"
    return out


def check_plan(plan: Plan, cost: CostModel, req: Request) -> str:
    """What must hold for a plan (empty string: all of it)."""
    graph = cost.graph
    try:
        progs = validate_plan(graph, plan, cost, req)
    except InvalidPlan as exc:
        return f"the plan returned is invalid: {exc}"
    memory = worker_memory(plan, progs, cost, req)
    over = [w for w, need in memory.items() if need > cost.hw.devices[w].memory]
    if over:
        return f"workers {over} need more memory than they have"
    try:
        result = simulate(plan, cost, req)
    except Exception as exc:  # noqa: BLE001
        return f"the simulator failed on a validated plan: {type(exc).__name__}: {exc}"
    if not (math.isfinite(result.step_time_s) and result.step_time_s > 0):
        return f"the predicted step time is {result.step_time_s}"
    if plan.meta.get("scheduler") == "opfence":
        speeds = {w: device_speed(cost.hw.devices[w]) for w in plan.workers}
        for s in plan.stages:
            if not has_params(graph, s.nodes) and any(speeds[w] > min(speeds.values()) for w in s.workers):
                return f"stage {s.index} has no parameters but runs on worker {s.workers}, faster than the plan's slowest device"
    if programs(graph, plan).keys() != set(plan.workers):
        return "not every worker of the plan has a program"
    return ""
