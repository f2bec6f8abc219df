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
schedule goes on where it was, and its batches are ones no earlier grouping read. Each grouping
runs through the one step of every group (``steps.py``); a grouping of one group is the
synchronous step loop (``training.py``), with its recovery, re-plans, evictions and stops.
"""

from __future__ import annotations

import time
from typing import Any

from fusionllm.core.config import TrainResult
from fusionllm.core.tensorboard import MetricsWriter

from .config import Evict, Replan, Run, WorkerLost
from .context import RunContext
from .grouping import Grouping, choose, groupings
from .hier_setup import GroupSetup
from .hierarchical import Groups
from .recovery import Recovery
from .restart import Interrupted, Stopper, final_checkpoint, resume_event, start_or_resume
from .setup import Setup
from .state import Checkpoints
from .steps import StepRunner, measured_links
from .training import SyncLoop
from .workers import Liveness


class Phases:
    """Runs the groupings one after the other; ``run`` is the plan in force (the coordinator's
    shutdown closes its clients)."""

    def __init__(self, ctx: RunContext, setup: Setup, checkpoints: Checkpoints, live: Liveness, runner: StepRunner,
                 recovery: Recovery, stopper: Stopper, began: float) -> None:
        self.ctx, self.setup, self.checkpoints, self.live, self.runner = ctx, setup, checkpoints, live, runner
        self.recovery, self.stopper, self.began = recovery, stopper, began
        self.run: Run | None = None

    async def train(self) -> TrainResult:
        ctx, c = self.ctx, self.ctx.cluster
        plan = groupings(c.sync, c.groups, c.regroup, ctx.train.steps)
        result = TrainResult()
        states: list[Any] | None = None
        data_from = 0
        with MetricsWriter(ctx.train.metrics, ctx.train.log_to) as ctx.metrics:
            k = 0
            while k < len(plan):
                plan[k] = grouping = await choose(ctx, GroupSetup(ctx, self.setup, self.checkpoints), plan[k])  # decided once, here
                final = k + 1 == len(plan)
                regroup = k > 0 and not grouping.replanned
                if regroup:
                    began = time.perf_counter()
                    ctx.say(f"regrouping at step {grouping.first}: {plan[k - 1].describe()} -> {grouping.describe()}")
                if grouping.groups is None:
                    part, states, data_from = await self.one(grouping, states, data_from, final=final)
                else:
                    part, states, data_from, again = await self.several(grouping, states, data_from, final=final)
                    if again is not None:  # a re-plan: the rest of this grouping, planned again from the outer weights
                        plan[k:k + 1] = [Grouping(grouping.first, again.first, grouping.groups), again]
                if regroup:
                    ctx.event({"event": "regroup", "at_step": grouping.first, "from": plan[k - 1].describe(), "to": grouping.describe(),
                               "groups": grouping.groups, "seconds": round(time.perf_counter() - began, 3)})
                merge(result, part)
                k += 1
        return result

    async def one(self, grouping: Grouping, states: list[Any] | None, data_from: int, *, final: bool) -> tuple[TrainResult, list[Any] | None, int]:
        """A synchronous grouping: the step loop with its recovery, re-plans, evictions and stops."""
        ctx = self.ctx
        if states is None:  # the run's start: from scratch, a checkpoint or the workers' live state
            run, resumed = await start_or_resume(ctx, self.setup, self.checkpoints, self.began)
        else:
            run, resumed = await self.setup.setup(carry=(states, grouping.first)), None
        self.run = run
        ctx.status.state = "running"
        ctx.metrics.write(self.setup.plan_record)
        if resumed is not None:
            ctx.event(resumed)
        loop = SyncLoop(ctx, self.runner, self.checkpoints, self.live, self.stopper.stop_if_asked, lambda: self.recovery.replans)
        offset = data_from - grouping.first
        self.stopper.training = True
        while True:
            try:
                part = await loop.train(run, end=grouping.last, data_offset=offset)
                break
            except WorkerLost as lost:
                run = self.run = await self.recovery.recover(run, lost)
            except Replan as again:
                run = self.run = await self.recovery.replan(run, again)
            except Evict as ev:
                run = self.run = await self.recovery.evict(run, ev)
            except Interrupted as stop:  # Ctrl+C or SIGTERM, between two steps
                raise await final_checkpoint(self.stopper.stopping, self.checkpoints, self.live, run, stop.done, ctx.say) from None
        self.stopper.training = False
        if final:
            return part, None, grouping.last + offset
        states = list((await self.live.guard(run, self.checkpoints.stage_states(run))).values())
        await self.recovery.leave(run, set())
        self.run = None
        return part, states, grouping.last + offset

    async def several(self, grouping: Grouping, states: list[Any] | None, data_from: int, *,
                      final: bool) -> tuple[TrainResult, list[Any] | None, int, Grouping | None]:
        """A grouping of several groups, each with its own step clock (``hierarchical.py``). A group
        far slower than its plan ends every group at the next round boundary: the rest of the
        grouping is returned (the planner's groups, from the step reached) to be planned again."""
        ctx = self.ctx
        group_setup = GroupSetup(ctx, self.setup, self.checkpoints)
        hr = await group_setup.setup_groups(groups=grouping.groups or None, first=grouping.first, last=grouping.last, states=states,
                                            data_from=data_from, hier=grouping.hier)
        ctx.status.state = "running"
        ctx.metrics.write(self.setup.plan_record)
        if group_setup.resumed is not None:
            ctx.event(resume_event(ctx, group_setup.resumed, self.began))
        groups = Groups(ctx, group_setup, self.checkpoints, self.live, self.runner, self.recovery.send_away, lambda: self.recovery.replans)
        again = None
        try:
            part = await groups.train(hr)
            if hr.clock.end_at is not None and hr.clock.reached() < grouping.last:
                again = Grouping(hr.clock.reached(), grouping.last, [], replanned=True)
                self.recovery.replans += 1
                self.setup.measured = {link: bps for run in hr.runs.values() for link, bps in measured_links(run).items()}
                ctx.event({"event": "replan", "why": hr.clock.replan_why, "at_step": again.first, "round": hr.clock.end_at, "sync": "hierarchical"})
                final = False
            if not final:  # every average applied: each group holds the same outer weights and momentum
                run = hr.runs[min(hr.alive)]
                states = [await self.live.guard(run, self.checkpoints.read_state(run, s.workers[0], outer=True)) for s in run.plan.stages]
        finally:
            for client in next(iter(hr.runs.values())).clients.values():
                await client.close()
        if not final:
            ctx.clock.new_epoch()
        return part, None if final else states, hr.data.next, again


def merge(total: TrainResult, part: TrainResult) -> None:
    """``part`` (one grouping's) added to the run's result."""
    total.losses += part.losses
    total.val_losses += part.val_losses
    total.val_metrics += part.val_metrics
    total.tokens += part.tokens
    total.elapsed_s += part.elapsed_s
    total.num_params = max(total.num_params, part.num_params)
