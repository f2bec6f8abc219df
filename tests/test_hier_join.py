"""The join of a group's healthy workers after their group left, decided before any other group moves on.

Why it can fail: the coordinator that learns of the spares only later (the pauser's next poll, or
after the Abort it sends them) lets the groups left run on meanwhile; a fast group then reaches
its last round first and the spares stay idle, which depends on the machine's load (the process
test ``test_group_guards_process`` saw it). Or a pause that starts before the aborted workers are
spares forms a group without them. ``Groups.left`` with fakes (no processes): what the run holds
while the Abort is in flight, and after it.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from fusionllm.control.hier_setup import GroupingRun
from fusionllm.control.hierarchical import Groups
from fusionllm.control.rounds import DataOffsets, PauseSchedule, RoundClock


def groups_and_run(current: dict[int, int], rounds: int = 8) -> tuple[Groups, GroupingRun, list[dict[str, Any]], list[str]]:
    """Groups 0 (workers 0, 1, 2) and 1 (worker 3) at rounds ``current``; the Abort records what the run held meanwhile."""
    said: list[str] = []
    ctx: Any = SimpleNamespace(cluster=SimpleNamespace(outer_aggregate="mean"), membership=SimpleNamespace(spares=set(), members={}),
                               say=said.append, event=lambda record: None, run_seconds=lambda s: s)
    seen: list[dict[str, Any]] = []
    hr = GroupingRun(hier=None, graph=None, runs={0: SimpleNamespace(plan=SimpleNamespace(workers=[0, 1, 2])),  # type: ignore[arg-type]
                                              1: SimpleNamespace(plan=SimpleNamespace(workers=[3]))},
                 alive={0, 1}, clock=RoundClock(0, 8 * rounds, {0: [4] * rounds, 1: [4] * rounds}, current=dict(current)),
                 data=DataOffsets(0, 2), pausing=PauseSchedule(set(), set()))

    class Live:
        async def abort(self, run: Any, workers: list[int]) -> set[int]:
            await asyncio.sleep(0)  # the other groups' tasks run here
            seen.append({"workers": workers, "join_at": hr.pausing.join_at, "pauses": set(hr.pausing.pauses), "leaving": hr.leaving,
                         "spares": set(ctx.membership.spares)})
            return set()

    setup: Any = SimpleNamespace(group_batch=lambda: 8)
    return Groups(ctx, None, Live(), None, send_away=None, group_setup=setup), hr, seen, said  # type: ignore[arg-type]


def test_the_join_of_a_groups_healthy_workers_is_scheduled_before_the_abort_lets_other_groups_run() -> None:
    groups, hr, seen, said = groups_and_run({0: 2, 1: 3})
    asyncio.run(groups.left(hr, 0, RuntimeError("worker 1 evicted"), gone={1}))
    # while the Abort was in flight: the pause after group 1's round is reserved, and no pause may start (leaving)
    assert seen == [{"workers": [0, 2], "join_at": 4, "pauses": {4}, "leaving": 1, "spares": set()}]
    assert hr.alive == {1} and hr.leaving == 0 and hr.pausing.join_at == 4 and hr.pausing.pauses == {4}
    assert groups.ctx.membership.spares == {0, 2}
    assert any("[0, 2] form a new group at outer round 4" in s for s in said), said


def test_workers_whose_group_leaves_in_the_last_round_are_not_scheduled_to_join() -> None:
    groups, hr, seen, _ = groups_and_run({0: 2, 1: 7})
    asyncio.run(groups.left(hr, 0, RuntimeError("worker 1 evicted"), gone={1}))
    assert [s["join_at"] for s in seen] == [None]
    assert hr.pausing.join_at is None and not hr.pausing.pauses and hr.leaving == 0
    assert groups.ctx.membership.spares == {0, 2}  # spares all the same: the pauser says they stay idle


def test_a_group_with_no_healthy_worker_left_schedules_no_join() -> None:
    groups, hr, seen, _ = groups_and_run({0: 2, 1: 3})
    told: list[str] = []

    async def call_retrying(method: str, msg: dict, **kw: Any) -> dict:
        told.append(method)
        return {}

    hr.runs[0] = SimpleNamespace(plan=SimpleNamespace(workers=[1]), clients={1: SimpleNamespace(call_retrying=call_retrying)})  # type: ignore[assignment]
    asyncio.run(groups.left(hr, 0, RuntimeError("worker 1 evicted"), gone={1}))
    assert not seen and told == ["Abort"]  # nobody to keep: the evicted one is told to abort, not to wait as a spare
    assert hr.pausing.join_at is None and not hr.pausing.pauses and hr.alive == {1} and not groups.ctx.membership.spares
