"""A run as a sequence of groupings: one group (synchronous) or several, switched at a pause.

A run starts as one group (``--sync synchronous``), several (``--sync hierarchical``) or whichever
the planner predicts to reach a target loss first (``--sync auto``: the planner's groupings, where
one synchronous group runs as ``--sync synchronous`` would) and, with
``--regroup STEP:GROUPS``, becomes another grouping at each STEP: from one group to several, from
several to one, or to other groups. A regroup is one operation at a pause, from live weights:

- from one group: the stages' weights and AdamW state (as a re-plan reads them);
- from several groups: every group ends its last round with every average applied, so all hold
  the same outer weights; one group's outer weights and outer momentum are read (the momentum
  follows to the next grouping of several groups; one group has no outer step).

Where the planner forms the groups, it is asked once per grouping before anything is set up
(``grouping.choose``); its answer, one group or several, is the grouping that runs. The next
grouping is planned and assigned with them, and trains on from STEP: the learning-rate
schedule goes on where it was, and its batches are ones no earlier grouping read. Every grouping
is set up by one entry point (``GroupSetup.setup_grouping``) and runs through one round loop
(``hierarchical.Groups``) and the one step of every group (``steps.py``); a round of one group is
one step, with no outer sync and no pause, and what its plan cannot go on from (lost workers,
evictions, a re-plan, a stop) is handled here by ``Recovery`` and ``restart.py``.
"""

from __future__ import annotations

import time
from typing import Any

from fusionllm.core.config import TrainResult
from fusionllm.core.metrics import StepRecord
from fusionllm.core.tensorboard import MetricsWriter

from .calibration import Calibrator
from .config import Evict, Replan, Run, WorkerLost
from .context import RunContext
from .finalists import Finalists, alone_device
from .grouping import Grouping, choose, groupings
from .hier_setup import GroupingRun, GroupSetup, one_group
from .hierarchical import Groups
from .recovery import Recovery
from .restart import Interrupted, Stopper, final_checkpoint
from .setup import Setup
from .state import Checkpoints
from .steps import StepRunner, measured_links
from .workers import Liveness


class Phases:
    """Runs the groupings one after the other; ``run`` is the plan in force (the coordinator's
    shutdown closes its clients)."""

    def __init__(self, ctx: RunContext, setup: Setup, checkpoints: Checkpoints, live: Liveness, runner: StepRunner,
                 recovery: Recovery, stopper: Stopper, began: float) -> None:
        self.ctx, self.setup, self.checkpoints, self.live, self.runner = ctx, setup, checkpoints, live, runner
        self.recovery, self.stopper, self.began = recovery, stopper, began
        self.trained_until: float | None = None  # when the last grouping's training ended (a regroup's switch is timed from it)
        self.switch_s: float | None = None  # the last regroup's switch: last step of one grouping to the set-up of the next done
        self.run: Run | None = None
        self.calibrator = Calibrator(ctx, setup)  # predictions fitted to the measured steps
        self.finalists = Finalists(ctx)  # --sync auto: the planner's finalists measured, the best committed to

    async def train(self) -> TrainResult:
        try:
            return await self.groupings()
        finally:
            await self.calibrator.close()

    async def groupings(self) -> TrainResult:
        """Every grouping of the run, in order; the finalists' trials and checks among them."""
        ctx, c = self.ctx, self.ctx.cluster
        plan = groupings(c.sync, c.groups, c.regroup, ctx.train.steps)
        result = TrainResult()
        states: list[Any] | None = None
        data_from = 0
        with MetricsWriter(ctx.train.metrics, ctx.train.log_to) as ctx.metrics:
            k = 0
            while k < len(plan):
                group_setup = GroupSetup(ctx, self.setup, self.checkpoints)
                decided = self.finalists.decided(plan[k])  # the best measured finalist, or a check of the one committed to
                if decided is not None:
                    plan[k:k + 1] = decided
                plan[k] = grouping = await choose(ctx, group_setup, plan[k])  # decided once, here
                trials = self.finalists.trials(grouping)  # the planner's finalists, each trained a few steps first
                if trials is not None:
                    plan[k:k + 1] = trials
                    grouping = plan[k]
                final = k + 1 == len(plan)
                regroup = k > 0 and not grouping.replanned
                if regroup:
                    began = time.perf_counter()
                    ctx.say(f"regrouping at step {grouping.first}: {plan[k - 1].describe()} -> {grouping.describe()}")
                self.calibrator.reset()
                self.finalists.begin()
                part, states, data_from, again = await self.grouping(group_setup, grouping, states, data_from, final=final)
                self.finalists.ended(grouping)
                if again is not None:  # a re-plan: the rest of this grouping, planned again from the outer weights
                    plan[k:k + 1] = [Grouping(grouping.first, again.first, grouping.groups), again]
                if regroup:
                    ctx.event({"event": "regroup", "at_step": grouping.first, "from": plan[k - 1].describe(), "to": grouping.describe(),
                               "groups": grouping.groups, "seconds": round(time.perf_counter() - began, 3),
                               "switch_s": None if self.switch_s is None else round(self.switch_s, 3)})
                merge(result, part)
                k += 1
        return result

    async def grouping(self, group_setup: GroupSetup, grouping: Grouping, states: list[Any] | None, data_from: int, *,
                       final: bool) -> tuple[TrainResult, list[Any] | None, int, Grouping | None]:
        """One grouping, set up (``GroupSetup.setup_grouping``) and trained through the one round loop
        (``hierarchical.Groups``); returns its result, the weights the next grouping starts from (None
        after the last), the first batch no grouping read yet, and, when a group of several was far
        slower than its plan, the rest of the grouping to plan again (every group ended at a round
        boundary). One group's lost workers, evictions, re-plans and stops raise out of the loop and
        are handled here (``Recovery``, ``restart.py``); several groups handle theirs in the loop."""
        ctx = self.ctx
        hr, run = await group_setup.setup_grouping(groups=grouping.groups, first=grouping.first, last=grouping.last, states=states,
                                                   data_from=data_from, hier=grouping.hier, began=self.began,
                                                   alone=alone_device(grouping))
        self.switch_s = None if self.trained_until is None else time.perf_counter() - self.trained_until
        one, offset = run is not None, data_from - grouping.first
        hr.clock.shift = self.schedule_shift(grouping, hr.clock.first)
        self.run = run
        ctx.status.state = "running"
        ctx.metrics.write(self.setup.plan_record)
        if group_setup.resume_record is not None:
            ctx.event(group_setup.resume_record)
        self.stopper.training = one  # several groups stop at once (no step in flight to wait for)
        try:
            while True:
                groups = Groups(ctx, self.checkpoints, self.live, self.runner, self.recovery.send_away, lambda: self.recovery.replans,
                                group_setup=None if one else group_setup, stop_if_asked=self.stopper.stop_if_asked if one else lambda _: None,
                                observe=self.observe)
                try:
                    part = await groups.train(hr)
                    self.trained_until = time.perf_counter()
                    break
                except (WorkerLost, Replan, Evict) as exc:
                    if run is None:
                        raise
                    run = self.run = await self.recovery.handle(run, exc)  # the same group, planned again
                    hr = one_group(run, ctx.clock.start_step, grouping.last, offset)
                    hr.clock.shift = self.schedule_shift(grouping, hr.clock.first)
                except Interrupted as stop:  # Ctrl+C or SIGTERM, between two steps of one group
                    assert run is not None
                    raise await final_checkpoint(self.stopper.stopping, self.checkpoints, self.live, run, stop.done, ctx.say) from None
            self.stopper.training = False
            again = self.replanned(hr, grouping) if run is None else None
            final = final and again is None
            if final:
                states = None
            elif run is not None:  # one group: its live weights and AdamW state carry over
                states = list((await self.live.guard(run, self.checkpoints.stage_states(run))).values())
            else:  # every average applied: each group holds the same outer weights and momentum
                states = await self.outer_states(hr)
        finally:
            self.stopper.training = False
            if run is None:
                for client in next(iter(hr.runs.values())).clients.values():  # (one dict, shared by the groups' runs)
                    await client.close()
        data_next = grouping.last + offset if one else hr.data.next
        if not final and run is not None:
            await self.recovery.leave(run, set())
            self.run = None
        elif not final:
            ctx.clock.new_epoch()
        return part, states, data_next, again

    def schedule_shift(self, grouping: Grouping, first: int) -> float:
        """How far the run's tokens so far (in global batches) are ahead of step ``first`` (where the
        grouping, or the plan a recovery or re-plan made inside it, starts): a
        finalist's trial of groups of several H rounds its rounds up and trains more tokens than its
        steps, and every grouping after it reads the learning-rate schedule at the run's tokens (the
        protocol's "lr off", issue 58). 0 for any other grouping (a resumed run counts its tokens anew)."""
        tokens = self.ctx.trained_last[1]
        if not (grouping.trial or grouping.committed) or tokens <= 0:
            return 0.0
        return tokens / (self.ctx.train.batch_size * self.ctx.task.items_per_row) - first

    async def observe(self, run: Run, record: StepRecord, rows: int, one: bool) -> None:
        """Every step record before it is written: the calibration, the finalists' measurement."""
        await self.calibrator.observe(run, record, rows, one)
        self.finalists.observe(record)

    def replanned(self, hr: GroupingRun, grouping: Grouping) -> Grouping | None:
        """The rest of a grouping of several groups that a re-plan ended early (every group at one
        round boundary), to be planned again; None when it ran to its end."""
        if hr.clock.end_at is None or hr.clock.reached() >= grouping.last:
            return None
        self.recovery.replans += 1
        self.setup.measured = {link: bps for run in hr.runs.values() for link, bps in measured_links(run).items()}
        again = Grouping(hr.clock.reached(), grouping.last, [], replanned=True)
        self.ctx.event({"event": "replan", "why": hr.clock.replan_why, "at_step": again.first, "round": hr.clock.end_at, "sync": "hierarchical"})
        return again

    async def outer_states(self, hr: GroupingRun) -> list[Any]:
        """One group's outer weights and momentum (every group holds the same ones)."""
        run = hr.runs[min(hr.alive)]
        return [await self.live.guard(run, self.checkpoints.read_state(run, s.workers[0], outer=True)) for s in run.plan.stages]


def merge(total: TrainResult, part: TrainResult) -> None:
    """``part`` (one grouping's) added to the run's result."""
    total.losses += part.losses
    total.val_losses += part.val_losses
    total.val_metrics += part.val_metrics
    total.tokens += part.tokens
    total.elapsed_s += part.elapsed_s
    total.num_params = max(total.num_params, part.num_params)
