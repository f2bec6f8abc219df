"""The plan in force's prediction, calibrated on its own steps (``planning/calibrate.py``).

Every step record of every group passes here before it is written (``hierarchical.Groups``'s
``observe``). Once a plan has run its warm-up and ``calibrate.FIT_AFTER`` more steps, and every
``calibrate.REFIT_EVERY`` after that, the cost model is fitted to them: the plan's
``predicted_step_s`` becomes the calibrated prediction (the step records carry it from then on, and
the re-plan rule compares with it), an event records the prediction before and after and the fitted
speeds, and ``Setup`` plans every later plan (a re-plan, a regroup, a finalist) with those speeds.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fusionllm.core.metrics import StepRecord
from fusionllm.cost.model import CostModel
from fusionllm.planning.calibrate import Samples, fit
from fusionllm.schedule.plan import Request

from .config import Run
from .context import RunContext
from .setup import Setup


class Calibrator:
    """Measured steps per plan in force, and the fits made of them."""

    def __init__(self, ctx: RunContext, setup: Setup) -> None:
        self.ctx, self.setup = ctx, setup
        self.plans: dict[int, tuple[Run, Samples]] = {}  # by id(run); the run is kept so that its id is not reused
        self.costs: dict[int, CostModel] = {}
        self.failed: set[int] = set()

    def reset(self) -> None:
        """A new grouping: its plans are new ones."""
        self.plans.clear()
        self.costs.clear()
        self.failed.clear()

    async def observe(self, run: Run, record: StepRecord, rows: int, one: bool) -> None:
        """One step record of ``run`` (``rows`` a step, ``one``: a grouping of one group, whose records'
        ``elapsed_s`` is its own clock): measured, and the plan calibrated when due."""
        key = id(run)
        _, samples = self.plans.setdefault(key, (run, Samples()))
        samples.add(step_s=record.step_s, cpu_s=record.cpu_s, elapsed_s=record.elapsed_s if one else None)
        if key in self.failed or not samples.due():
            return
        hw_size = len(self.ctx.membership.members)
        if any(w >= hw_size for w in run.plan.workers) or set(self.ctx.membership.members) != set(range(hw_size)):
            self.failed.add(key)  # worker ids are not hardware indices (a worker was lost): nothing to fit to
            return
        try:
            cost = self.costs.get(key) or await self.base_cost(run)
            self.costs[key] = cost
            req = Request(rows, self.ctx.task.items_per_row, run.plan.micro_batches, run.plan.schedule)
            cal = await asyncio.to_thread(fit, run.plan, cost, req, samples.recent())
        except Exception as exc:  # a plan the simulator cannot run (its own check failed): say so once, never stop training
            self.failed.add(key)
            self.ctx.say(f"calibration: the running plan could not be simulated ({type(exc).__name__}: {exc}); predictions stay uncalibrated")
            return
        meta = run.plan.meta
        first = meta.setdefault("predicted_step_s_before", meta.get("predicted_step_s", cal.before_s))
        meta["predicted_step_s"] = cal.after_s
        record.predicted_step_s = round(cal.after_s, 4)
        self.setup.calibration.update(cal.speed)
        event: dict[str, Any] = {"event": "calibrated", "at_step": record.step, **cal.to_json(), "predicted_step_s_before": round(first, 4),
                                 "simulated_step_s_before": round(cal.before_s, 4)}
        if record.group is not None:
            event["group"] = record.group
        self.ctx.event(event)
        self.ctx.say(f"calibrated at step {record.step}{'' if record.group is None else f' (group {record.group})'}: predicted "
                     f"{first:.3f} s/step before, {cal.after_s:.3f} s after, measured {cal.measured_s:.3f} s (median of {cal.steps} steps); "
                     f"device speeds x " + ", ".join(f"w{w} {f:.2f}" for w, f in sorted(cal.speed.items())))

    async def base_cost(self, run: Run) -> CostModel:
        """The uncalibrated cost model of ``run``'s graph on the members' hardware (speeds are fitted against it)."""
        hw = await self.setup.hardware(run.clients, calibrated=False)
        work = await asyncio.to_thread(self.ctx.task.estimate, run.graph)
        return CostModel(run.graph, work, hw, recompute=self.ctx.train.recompute)
