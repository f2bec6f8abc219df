"""How many of a plan's stage boundaries AdaTopK compresses, and the budget share each gets (control/steps.py)."""

from __future__ import annotations

import math

from fusionllm.planning.adatopk import budget_scale, compressed_cuts
from fusionllm.schedule.plan import Plan, StagePlan


class _Policy:
    def __init__(self, ratios: dict[tuple[int, int], float]) -> None:
        self._ratios = ratios

    def ratios(self) -> dict[tuple[int, int], float]:
        return self._ratios


def _plan(*workers: list[int]) -> Plan:
    return Plan([StagePlan(i, [f"n{i}"], list(w)) for i, w in enumerate(workers)])


def test_a_cut_counts_when_any_link_across_it_is_compressed_either_way() -> None:
    plan = _plan([0], [1, 2], [3])  # a replicated middle stage: two links cross each cut
    assert compressed_cuts(plan, _Policy({(0, 1): 1.0, (1, 0): 1.0})) == 0
    assert compressed_cuts(plan, _Policy({(2, 0): 0.1})) == 1  # gradients back over one replica's link
    assert compressed_cuts(plan, _Policy({(0, 1): 0.1, (3, 2): 0.2})) == 2
    assert compressed_cuts(plan, _Policy({(0, 3): 0.1})) == 0  # the tied weights' all-reduce is no cut
    assert compressed_cuts(plan, None) == 0


def test_k_cuts_get_one_over_sqrt_k_of_the_budget() -> None:
    plan = _plan([0], [1], [2], [3])
    assert budget_scale(plan, None) == 1.0
    assert budget_scale(plan, _Policy({(0, 1): 0.1})) == 1.0
    assert math.isclose(budget_scale(plan, _Policy({(0, 1): 0.1, (1, 2): 0.1, (3, 2): 0.1})), 1 / math.sqrt(3))
