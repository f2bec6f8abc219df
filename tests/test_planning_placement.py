"""Capability placement is a constraint inside the planner: OP-Fence judges candidates as they will run."""

from __future__ import annotations

from pathlib import Path

import pytest

from fusionllm.cluster.hardware import Hardware
from fusionllm.cluster.random import ClusterShape, random_cluster_toml
from fusionllm.cluster.spec import load_cluster
from fusionllm.core.errors import FusionError
from fusionllm.models.spec import build_model
from fusionllm.planning.choose import choose_plan
from fusionllm.planning.predict import predict
from fusionllm.runtime.backends.model_graph import trace_lm
from fusionllm.runtime.backends.profile import estimate
from fusionllm.schedule.plan import Plan, Request


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_worker_no_placement_accepts_is_planned_around_and_the_prediction_is_the_placed_plans(tmp_path: Path, seed: int) -> None:
    path = tmp_path / "c.toml"
    path.write_text(random_cluster_toml(seed, ClusterShape(sites=(2, 3), devices=(4, 6), kind="gpu")))
    hw = Hardware.from_spec(load_cluster(path))
    req = Request(16, 64, 4)
    graph = trace_lm(build_model("gpt-micro", 256, device="meta"), 4, 64, spec="gpt-micro")
    work = estimate(graph)
    free, _ = choose_plan(graph, hw, "opfence", req, work=work, say=lambda _: None)
    banned = free.workers[0]  # the device the unconstrained plan wants first can run nothing (say, a NumPy worker and a torch-only op)
    seen: list[Plan] = []

    def place(plan: Plan) -> Plan:
        seen.append(plan)
        if banned in plan.workers:
            raise FusionError(f"worker {banned} cannot run op kinds ['x']")
        return plan

    plan, cost = choose_plan(graph, hw, "opfence", req, work=work, say=lambda _: None, place=place)
    assert banned not in plan.workers and len(seen) > 1
    assert plan.meta["predicted_step_s"] == pytest.approx(predict(plan, cost, req))
