"""The one prediction every planner compares its candidates by: the simulator's step time."""

from __future__ import annotations

from fusionllm.cost.model import CostModel
from fusionllm.schedule.plan import Plan, Request
from fusionllm.sim.simulator import simulate


def predict(plan: Plan, cost: CostModel, req: Request) -> float:
    """The simulator's step time of ``plan``: how OP-Fence and the codec choice compare candidates."""
    return simulate(plan, cost, req).step_time_s
