"""The plan in force's prediction, calibrated on its own steps (``planning/calibrate.py``).

Every step record of every group passes here before it is written (``hierarchical.Groups``'s
``observe``). Once a plan has run its warm-up and ``calibrate.FIT_AFTER`` more steps, and every
``calibrate.REFIT_EVERY`` after that, the cost model is fitted to them: the plan's
``predicted_step_s`` becomes the calibrated prediction (the step records carry it from then on, and
the re-plan rule compares with it), an event records the prediction before and after and the fitted
speeds, and ``Setup`` plans every later plan (a re-plan, a regroup, a finalist) with those speeds. A
later plan's own prediction is made again with the fitted speeds and overhead once it starts
(an event with ``carried``), before its own steps refine it.

The cost model and the fits are made off the step loop (tasks; the simulator in a thread): a step
never waits for them, and a fit lands in the first record after it is done.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

from fusionllm.core.metrics import StepRecord
from fusionllm.cost.model import CostModel
from fusionllm.planning.calibrate import Calibration, Samples, fit, predicted
from fusionllm.schedule.plan import Request

from .config import Run
from .context import RunContext
from .setup import Setup


@dataclass
class _Tracked:
    """One plan in force: its measured steps, its uncalibrated cost model (a task), the fit under way."""

    run: Run  # (kept so that its id is not reused while tracked)
    samples: Samples = field(default_factory=Samples)
    cost: asyncio.Task | None = None
    fitting: asyncio.Task | None = None
    carried: bool = False  # predicted again with an earlier plan's fit
    off: bool = False
    shared: frozenset[str] = frozenset()  # workers whose process holds other workers too (in-process): their CPU is not their own


def shared_processes(members: dict[int, Any]) -> frozenset[str]:
    """Workers (as the records name them) that share their process with another member (an
    in-process cluster): the process's CPU time is not theirs alone."""
    where: dict[tuple[str, int], list[int]] = {}
    for w, m in members.items():
        info = getattr(m, "info", None)
        pid = getattr(info, "pid", 0)
        if pid:
            where.setdefault((getattr(info, "hostname", ""), pid), []).append(w)
    return frozenset(str(w) for ws in where.values() if len(ws) > 1 for w in ws)


class Calibrator:
    """Measured steps per plan in force, and the fits made of them."""

    def __init__(self, ctx: RunContext, setup: Setup) -> None:
        self.ctx, self.setup = ctx, setup
        self.plans: dict[int, _Tracked] = {}  # by id(run)
        self.overhead: float | None = None  # the last fit's per-step overhead (a later plan is predicted with it)

    def reset(self) -> None:
        """A new grouping: its plans are new ones (what is under way for the old ones is dropped)."""
        for t in self.plans.values():
            for task in (t.cost, t.fitting):
                if task is not None:
                    task.cancel()
        self.plans.clear()

    async def observe(self, run: Run, record: StepRecord, rows: int, one: bool) -> None:
        """One step record of ``run`` (``rows`` a step, ``one``: a grouping of one group, whose records'
        ``elapsed_s`` is its own clock): measured, a finished fit applied, a due one started."""
        t = self.plans.get(id(run))
        if t is None:
            t = self.plans[id(run)] = _Tracked(run, carried=self.overhead is None)  # (nothing fitted yet: nothing to carry)
            n = len(self.ctx.membership.members)
            t.off = any(w >= n for w in run.plan.workers) or set(self.ctx.membership.members) != set(range(n))  # ids are not hardware indices
            if not t.off:
                t.cost = asyncio.create_task(self.base_cost(run))
            t.shared = shared_processes(self.ctx.membership.members)
        cpu = {w: v for w, v in record.cpu_s.items() if w not in t.shared}
        t.samples.add(step_s=record.step_s, cpu_s=cpu, elapsed_s=record.elapsed_s if one else None)
        if t.off:
            return
        if t.fitting is not None and t.fitting.done():
            self.apply(t, t.fitting, record)
            t.fitting = None
        if t.fitting is not None or t.cost is None or not t.cost.done():
            return
        if t.cost.cancelled() or t.cost.exception() is not None:
            self.give_up(t, t.cost.exception() if not t.cost.cancelled() else None)
            return
        cost: CostModel = t.cost.result()
        req = Request(rows, self.ctx.task.items_per_row, run.plan.micro_batches, run.plan.schedule)
        if t.samples.due():
            t.fitting = asyncio.create_task(asyncio.to_thread(fit, run.plan, cost, req, t.samples.recent()))
        elif not t.carried and self.overhead is not None and self.setup.calibration:
            t.carried = True
            speed = {w: self.setup.calibration.get(w, 1.0) for w in run.plan.workers}
            t.fitting = asyncio.create_task(asyncio.to_thread(predicted, run.plan, cost, req, speed, self.overhead))

    def apply(self, t: _Tracked, task: asyncio.Task, record: StepRecord) -> None:
        """A finished fit (a ``Calibration``) or carried prediction (seconds) into the plan and ``record``."""
        if task.cancelled() or task.exception() is not None:
            self.give_up(t, None if task.cancelled() else task.exception())
            return
        got: Calibration | float = task.result()
        meta = t.run.plan.meta
        first = meta.setdefault("predicted_step_s_before", meta.get("predicted_step_s", 0.0))
        after = got if isinstance(got, float) else got.after_s
        meta["predicted_step_s"] = after
        record.predicted_step_s = round(after, 4)
        event: dict[str, Any] = {"event": "calibrated", "at_step": record.step, "predicted_step_s_before": round(first, 4)}
        if isinstance(got, float):
            event.update(predicted_step_s=round(after, 4), carried=True)
        else:
            t.carried = True
            self.setup.calibration.update(got.speed)
            self.overhead = got.step_overhead_s
            event.update({**got.to_json(), "predicted_step_s_before": round(first, 4), "simulated_step_s_before": round(got.before_s, 4)})
        if record.group is not None:
            event["group"] = record.group
        self.ctx.event(event)
        where = "" if record.group is None else f" (group {record.group})"
        if isinstance(got, float):
            self.ctx.say(f"calibrated at step {record.step}{where}: the new plan predicted {first:.3f} s/step, {after:.3f} s with the fitted speeds")
        else:
            self.ctx.say(f"calibrated at step {record.step}{where}: predicted {first:.3f} s/step before, {after:.3f} s after, measured "
                         f"{got.measured_s:.3f} s (mean of {got.steps} steps); device speeds x "
                         + ", ".join(f"w{w} {f:.2f}" for w, f in sorted(got.speed.items())))

    def give_up(self, t: _Tracked, exc: BaseException | None) -> None:
        """No calibration for this plan (its simulation failed: say so once); training goes on."""
        t.off = True
        if exc is not None:
            self.ctx.say(f"calibration: the running plan could not be simulated ({type(exc).__name__}: {exc}); its prediction stays as planned")

    async def base_cost(self, run: Run) -> CostModel:
        """The uncalibrated cost model of ``run``'s graph on the members' hardware (speeds are fitted against it)."""
        hw = await self.setup.hardware(run.clients, calibrated=False)
        work = await asyncio.to_thread(self.ctx.task.estimate, run.graph)
        return CostModel(run.graph, work, hw, recompute=self.ctx.train.recompute)

    async def close(self) -> None:
        """Tasks still under way are dropped (the run ended)."""
        tasks = [x for t in self.plans.values() for x in (t.cost, t.fitting) if x is not None and not x.done()]
        self.reset()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
