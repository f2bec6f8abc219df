"""The coordinator's components, each built with fakes: no processes, no sockets.

Why these checks can fail: a component that reaches into another's attributes (it needs more than
its constructor's arguments, and building it with fakes fails), a step runner that applies a bad
step or retries a skipped one, a step loop that evaluates, checkpoints or re-plans at the wrong
steps, a regroup schedule that drops or misorders groupings.
"""

from __future__ import annotations

import asyncio
from collections import deque
from types import SimpleNamespace
from typing import Any

import pytest

from fusionllm.compress.budget import EARLY_BUDGET
from fusionllm.control.bad_steps import Strikes
from fusionllm.control.config import Evict, Replan
from fusionllm.control.context import RunContext, StepClock
from fusionllm.control.grouping import Grouping, groupings
from fusionllm.control.hier_setup import one_group
from fusionllm.control.hierarchical import Groups
from fusionllm.control.restart import Interrupted, Stopper
from fusionllm.control.status import RunStatus
from fusionllm.control.steps import StepRunner
from fusionllm.core.config import TrainConfig
from fusionllm.planning.noise_scale import NoiseScale
from fusionllm.transport.control import BadTensor, StepDone


def _reply(loss: float | None = 1.0, *, bad: bool = False) -> StepDone:
    if bad:
        return StepDone(skipped=True, bad=[BadTensor(1, 0, "act", "n3.0", 0, "non-finite")])
    return StepDone(losses={"0": loss, "1": loss})


class FakeLiveness:
    """Answers each Step from a script: one list of replies per attempt, in order."""

    def __init__(self, script: list[dict[int, StepDone]]) -> None:
        self.script, self.steps, self.caps = list(script), [], []

    async def call_step(self, run: Any, w: int, msg: Any) -> Any:
        self.steps.append((w, msg.step, msg.attempt))
        self.caps.append(msg.budget_cap)
        return None

    async def calls(self, run: Any, calls: dict[int, Any]) -> dict[int, StepDone]:
        for call in calls.values():
            await call
        return self.script.pop(0)

    async def raise_if_lost(self, run: Any, why: str) -> None:
        raise AssertionError(f"no worker is lost here ({why})")

    async def guard(self, run: Any, work: Any) -> Any:
        return await work


def _run() -> Any:
    plan = SimpleNamespace(workers=[0, 1], micro_batches=2, meta={}, stages=[])
    return SimpleNamespace(plan=plan, fed=set(), policy=None, actions={}, bytes_before={}, links={}, recent=deque(maxlen=8),
                           observed=False, graph=SimpleNamespace(num_params=lambda: 10), val_metric=None, noise=NoiseScale(), steps_seen=0,
                           baseline_s=None)


def _strikes(events: list[dict], evict_after: int = 3) -> Strikes:
    membership = SimpleNamespace(members={1: SimpleNamespace(address="10.0.0.2:7100")})
    return Strikes(SimpleNamespace(numeric_guard="retry", evict_after=evict_after, guard_factor=100.0), membership, events.append, lambda _: None)  # type: ignore[arg-type]


def test_the_step_runner_retries_a_bad_step_once_and_returns_the_good_attempt() -> None:
    events: list[dict] = []
    live = FakeLiveness([{0: _reply(bad=True), 1: _reply(bad=True)}, {0: _reply(2.0), 1: StepDone()}])
    runner = StepRunner(SimpleNamespace(), live, _strikes(events))  # type: ignore[arg-type]
    done = asyncio.run(runner.run(_run(), 7, 0.1))
    assert done is not None and done.loss == 2.0
    assert [a for _, _, a in live.steps] == [0, 0, 1, 1]  # both workers, attempt 0 then 1
    assert [(e["step"], e["action"]) for e in events] == [(7, "retry")]


def test_the_step_runner_skips_a_step_bad_twice_and_evicts_at_the_third_strike() -> None:
    events: list[dict] = []
    bad = {0: _reply(bad=True), 1: _reply(bad=True)}
    runner = StepRunner(SimpleNamespace(), FakeLiveness([bad, bad, bad]), _strikes(events))  # type: ignore[arg-type]
    assert asyncio.run(runner.run(_run(), 3, 0.1, data_step=9, group=2)) is None
    with pytest.raises(Evict) as ev:
        asyncio.run(runner.run(_run(), 4, 0.1, group=2))
    assert ev.value.workers == {1} and ev.value.next_step == 4
    assert [(e["step"], e["action"], e["group"]) for e in events] == [(3, "retry", 2), (3, "skip", 2), (4, "evict", 2)]


def test_the_step_runner_sends_adatopks_early_cap_only_to_a_run_with_a_policy() -> None:
    good = {0: _reply(2.0), 1: StepDone()}
    live = FakeLiveness([good, good])
    runner = StepRunner(SimpleNamespace(), live, _strikes([]))  # type: ignore[arg-type]
    compressed = _run()
    compressed.policy = SimpleNamespace(ratios=lambda: {(0, 1): 0.1})
    asyncio.run(runner.run(compressed, 0, 0.1, cap=EARLY_BUDGET))
    asyncio.run(runner.run(_run(), 0, 0.1, cap=EARLY_BUDGET))  # no policy: nothing is capped
    assert live.caps == [EARLY_BUDGET, EARLY_BUDGET, 1.0, 1.0]


class FakeRunner:
    """A step runner whose steps are all applied (or skipped where told), with their loss."""

    def __init__(self, skip: set[int] = frozenset(), seconds: Any = lambda step: 1.0) -> None:  # type: ignore[assignment]
        self.skip, self.ran, self.seconds, self.caps = skip, [], seconds, []

    async def run(self, run: Any, step: int, lr: float, *, data_step: int | None = None, group: int | None = None, cap: float = 1.0) -> Any:
        from fusionllm.control.steps import StepDoneAll

        self.ran.append((step, data_step))
        self.caps.append(cap)
        return None if step in self.skip else StepDoneAll({0: StepDone(seconds=self.seconds(step))}, 1.0 / (step + 1))


class FakeCheckpoints:
    def __init__(self) -> None:
        self.evaluated: list[int] = []
        self.written: list[int] = []

    async def evaluate(self, run: Any, batches: int, at_step: int, *, outer: bool = False) -> float:
        self.evaluated.append(at_step)
        return 0.5

    async def checkpoint(self, run: Any, done: int, **_: Any) -> None:
        self.written.append(done)


def _ctx(records: list[dict], **cluster: Any) -> RunContext:
    c = SimpleNamespace(eval_every=0, eval_batches=1, checkpoint_every=0, scheduler=None, replan_factor=2.0, max_replans=2, compress="none",
                        outer_aggregate="mean")
    c.__dict__.update(cluster)
    task = SimpleNamespace(items_per_row=4, metric_name="accuracy", eval_count=lambda n: n)
    return RunContext(TrainConfig(steps=10, warmup=0), c, task, SimpleNamespace(), RunStatus("m", 10), say=lambda _: None,  # type: ignore[arg-type]
                      on_step=records.append)


def _loop(ctx: RunContext, runner: Any, checkpoints: Any, replans: int = 0, stop_if_asked: Any = lambda _: None) -> Any:
    """The one round loop (``hierarchical.Groups``) as a grouping of one group runs it: no pauser, no outer sync."""
    async def send_away(run: Any, workers: set[int]) -> dict[int, str]:
        raise AssertionError("one group evicts through Recovery, not the loop")

    return Groups(ctx, checkpoints, FakeLiveness([]), runner, send_away, lambda: replans, stop_if_asked=stop_if_asked)  # type: ignore[arg-type]


def _train(loop: Any, run: Any, *, start: int = 0, end: int, data_offset: int = 0) -> Any:
    return asyncio.run(loop.train(one_group(run, start, end, data_offset)))


def test_one_groups_rounds_are_one_step_each_with_evaluations_checkpoints_and_skips_at_their_steps() -> None:
    records: list[dict] = []
    ctx = _ctx(records, eval_every=4, checkpoint_every=3)
    runner, checkpoints = FakeRunner(skip={5}), FakeCheckpoints()
    loop = _loop(ctx, runner, checkpoints)
    result = _train(loop, _run(), start=2, end=9, data_offset=100)
    assert [s for s, _ in runner.ran] == [2, 3, 4, 5, 6, 7, 8] and all(d == s + 100 for s, d in runner.ran)
    assert [r["step"] for r in records] == [2, 3, 4, 6, 7, 8]  # step 5 skipped: no record
    assert all(r.get("group") is None and r.get("round") is None for r in records)  # a synchronous run's records
    assert checkpoints.evaluated == [4, 8, 9] and [r["step"] for r in records if "val_loss" in r] == [3, 7, 8]
    assert checkpoints.written == [3, 6, 9]
    assert result.tokens == 7 * ctx.train.batch_size * 4


def test_the_one_loop_caps_adatopks_error_in_the_schedules_first_sixteenth() -> None:
    ctx = _ctx([])
    ctx.train = TrainConfig(steps=40, warmup=0)
    runner = FakeRunner()
    _train(_loop(ctx, runner, FakeCheckpoints()), _run(), end=5)
    assert runner.caps == [EARLY_BUDGET, EARLY_BUDGET, EARLY_BUDGET, 1.0, 1.0]  # steps 0-2 of 40: under 40/16


def test_one_group_asks_for_a_replan_when_steps_take_far_longer_than_predicted() -> None:
    """From the start only when far off the prediction (2 x --replan-factor: a link far slower than
    its file said); a plan merely slower than predicted is kept (planned again with the same cost
    model it would be as wrong); then against its own settled steps (a link that slowed down)."""
    ctx = _ctx([], scheduler="opfence")
    loop = _loop(ctx, FakeRunner(), FakeCheckpoints())
    with pytest.raises(Replan) as again:
        _train(loop, _run_with(0.2), end=20)  # the fake steps take 1 s: 5x the prediction, over 2 x 2
    assert again.value.next_step == 10  # the plan's own step time is known after 10 steps
    _train(loop, _run_with(0.3), end=20)  # 3.3x: kept
    slowed = _loop(ctx, FakeRunner(seconds=lambda step: 1.0 if step < 12 else 2.5), FakeCheckpoints())
    with pytest.raises(Replan) as again:
        _train(slowed, _run_with(0.9), end=40)
    assert again.value.next_step == 17 and "when the plan settled" in str(again.value)  # 5 of the last 8 steps slow: the median
    _train(_loop(ctx, FakeRunner(), FakeCheckpoints(), replans=2), _run_with(0.1), end=20)  # --max-replans reached: no more


def test_a_stop_asked_in_one_groups_rounds_interrupts_them_between_two_steps() -> None:
    asked: list[int] = []

    def stop_if_asked(step: int) -> None:
        asked.append(step)
        if step == 3:
            raise Interrupted(step)

    runner = FakeRunner()
    with pytest.raises(Interrupted) as stop:
        _train(_loop(_ctx([]), runner, FakeCheckpoints(), stop_if_asked=stop_if_asked), _run(), end=8)
    assert stop.value.done == 3 and [s for s, _ in runner.ran] == [0, 1, 2] and asked == [0, 1, 2, 3]


def _run_with(predicted: float) -> Any:
    run = _run()
    run.plan.meta["predicted_step_s"] = predicted
    return run


def test_a_stop_asked_between_two_steps_interrupts_the_loop_and_a_second_one_cancels_at_once() -> None:
    said: list[str] = []
    cancelled: list[bool] = []

    async def main() -> None:
        stopper = Stopper(SimpleNamespace(checkpoint_dir=None, stop_timeout=60.0), said.append)  # type: ignore[arg-type]
        stopper.main = SimpleNamespace(done=lambda: False, cancel=lambda: cancelled.append(True))  # type: ignore[assignment]
        stopper.training = True
        stopper.stop_if_asked(3)  # nothing asked yet
        stopper.request_stop()
        with pytest.raises(Interrupted) as stop:
            stopper.stop_if_asked(4)
        assert stop.value.done == 4 and not cancelled
        stopper.request_stop()  # again: at once
        assert cancelled == [True]
        stopper.end()

    asyncio.run(main())
    assert "stopping after the step in flight" in said[0] and "stopping now" in said[1]


def test_the_clock_is_the_one_owner_of_the_epoch_and_the_start_step() -> None:
    clock = StepClock()
    assert clock.new_epoch() == 1 and clock.new_epoch() == 2
    clock.follow(7)
    clock.follow(3)  # an older incarnation's epoch never takes it back
    clock.start_at(40)
    assert (clock.epoch, clock.start_step) == (7, 40)


def test_groupings_follow_sync_groups_and_regroups_in_order() -> None:
    assert groupings("synchronous", None, None, 10) == [Grouping(0, 10, None)]
    assert groupings("hierarchical", [[0], [1]], [(4, [[0, 1]]), (8, [[1], [0]]), (12, [[0], [1]])], 10) == [
        Grouping(0, 4, [[0], [1]]), Grouping(4, 8, None), Grouping(8, 10, [[1], [0]])]  # a regroup past the end is dropped
    assert groupings("hierarchical", None, None, 5) == [Grouping(0, 5, [])]  # the planner's groups


def test_the_round_clock_counts_every_group_in_the_users_steps() -> None:
    """A grouping of steps 10 to 16: group 0 of H 2 and group 1 of H 4, three rounds each. Why it
    can fail: a faster group's inner steps counted as steps of their own (its record past ``last``),
    a checkpoint's step counted in a group that is gone, a joining group that starts at round 0."""
    from fusionllm.control.rounds import RoundClock

    clock = RoundClock(10, 16, {0: [2, 2, 2], 1: [4, 4, 4]})
    assert [clock.user_step(0, i) for i in range(6)] == [10, 11, 12, 13, 14, 15]
    assert [clock.user_step(1, i) for i in range(12)] == [10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15]
    assert clock.rounds == 3 and clock.step_at(2, {0, 1}) == 14 and clock.step_at(3, {0, 1}) == 16
    clock.end_at = 2
    assert clock.reached() == 14  # a re-plan after round 1: the rest of the grouping starts at step 14
    clock.join(2, like=0, k0=2)
    assert clock.lengths[2] == [2, 2, 2] and clock.expected(1, {0, 1, 2}) == {0, 1} and clock.expected(2, {0, 1, 2}) == {0, 1, 2}


def test_data_offsets_give_every_group_batches_no_other_group_reads() -> None:
    from fusionllm.control.rounds import DataOffsets

    data = DataOffsets(start=100, n=2, next=100)
    first = {data.batch(g, i) for g in (0, 1) for i in range(6)}
    assert first == set(range(100, 112))  # the two groups interleave over the grouping's own batches
    data.join(2, longest=6)
    joined = {data.batch(2, i) for i in range(6)}
    assert not joined & first and min(joined) == 112
    for b in first | joined:
        data.read(b)
    assert data.next == 118  # where the next grouping's batches start


def test_the_planners_grouping_is_chosen_once_and_one_group_is_a_grouping() -> None:
    """Why it can fail: ``--sync auto`` that decides "one or several" in a set-up and switches by an
    exception, or asks the planner for groups it was given by hand."""
    from fusionllm.control.grouping import choose

    events: list[dict] = []
    asked: list[int] = []

    def ctx(sync: str) -> Any:
        cluster = SimpleNamespace(scheduler="opfence", sync=sync, micro_batches=1, token="t", tls=None, finalists=0)
        return SimpleNamespace(cluster=cluster, task=SimpleNamespace(trace=lambda rows: f"graph at {rows}"), say=lambda _: None, event=events.append,
                               membership=SimpleNamespace(members={}, incarnation=0))

    def setup(groups: list[list[int]]) -> Any:
        async def schedule(graph: str, clients: dict, steps: int, keep: list | None = None) -> Any:
            asked.append(steps)
            return SimpleNamespace(groups=[SimpleNamespace(workers=w) for w in groups], meta={"grouping": "g", "candidates": []})

        return SimpleNamespace(group_batch=lambda: 4, schedule=schedule)

    one = asyncio.run(choose(ctx("auto"), setup([[0, 1]]), Grouping(0, 8, [])))
    assert one == Grouping(0, 8, None) and one.hier is None and asked == [8]
    assert [(e["event"], e["groups"]) for e in events] == [("auto", 1)]
    two = asyncio.run(choose(ctx("auto"), setup([[0], [1]]), Grouping(4, 8, [], replanned=True)))
    assert two == Grouping(4, 8, [[0], [1]], replanned=True) and two.hier is not None and asked == [8, 4]
    held = asyncio.run(choose(ctx("hierarchical"), setup([[0]]), Grouping(0, 8, [[0]])))  # by hand: not asked
    assert held == Grouping(0, 8, [[0]]) and asked == [8, 4]
    several = asyncio.run(choose(ctx("hierarchical"), setup([[0, 1]]), Grouping(0, 8, [])))  # only --sync auto may answer one group
    assert several.groups == [[0, 1]] and len(events) == 2


def test_a_grouping_of_one_group_recovers_through_the_one_loop_by_planning_the_same_group_again() -> None:
    """Phases with fakes: a worker lost at step 4 of a one-group run goes to ``Recovery``, and the
    same round loop goes on from the step the new plan starts at (a checkpoint's, here 3), reading
    that step's batch again. Why it can fail: a second loop for one group that drifted, a lost
    worker that ends the run, a recovered run that restarts at step 0 or skips the steps lost."""
    from fusionllm.control.config import WorkerLost
    from fusionllm.control.phases import Phases

    records: list[dict] = []
    ctx = _ctx(records, sync="synchronous", groups=None, regroup=None, resume=False, checkpoint_every=0)
    ctx.membership = SimpleNamespace(members={})  # type: ignore[assignment]

    class LosingRunner(FakeRunner):
        async def run(self, run: Any, step: int, lr: float, **kw: Any) -> Any:
            if step == 4 and not lost:
                lost.append(step)
                raise WorkerLost({1}, "killed")
            return await super().run(run, step, lr, **kw)

    lost: list[int] = []
    runner = LosingRunner()
    handled: list[Any] = []

    async def setup(**kw: Any) -> Any:
        ctx.clock.start_at(0)
        return _run()

    async def handle(run: Any, exc: Any) -> Any:
        handled.append(exc)
        ctx.clock.start_at(3)  # the newest checkpoint's step
        return _run()

    recovery = SimpleNamespace(handle=handle, replans=0, send_away=None)
    stopper = Stopper(SimpleNamespace(checkpoint_dir=None, stop_timeout=60.0), lambda _: None)  # type: ignore[arg-type]
    phases = Phases(ctx, SimpleNamespace(setup=setup, plan_record={}), FakeCheckpoints(), FakeLiveness([]), runner, recovery, stopper, 0.0)  # type: ignore[arg-type]
    result = asyncio.run(phases.train())
    assert [type(e) for e in handled] == [WorkerLost] and lost == [4]
    assert [s for s, _ in runner.ran] == [0, 1, 2, 3, 3, 4, 5, 6, 7, 8, 9] and all(d == s for s, d in runner.ran)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 3, 4, 5, 6, 7, 8, 9] and len(result.losses) == 7  # the result: the plan in force's steps
    assert phases.run is not None and not stopper.training
