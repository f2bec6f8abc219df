"""A new plan when the old one cannot go on: lost workers, a plan gone slow, evicted workers.

Each of the three makes the next plan over the members left and carries the state over:

- **recover** (workers died or hung): the survivors drop the step in flight; the run goes on from
  the newest complete checkpoint, on the workers left and spares that joined.
- **replan** (the steps take far longer than the plan predicted, a link slowed down): the live
  weights and AdamW state, planned again with the links as measured.
- **evict** (a worker blamed for bad tensors ``--evict-after`` times): the live weights, planned
  again without it; the step runs again on the new plan.

Every one is a metrics event and writes the new plan's record.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from fusionllm.core.errors import FusionError

from .config import Evict, Replan, Run, WorkerLost
from .context import RunContext
from .setup import Setup
from .state import Checkpoints
from .steps import measured_links
from .workers import Liveness


class Recovery:
    """Lost workers, re-plans and evictions of a grouping of one group (``phases.py``)."""

    def __init__(self, ctx: RunContext, setup: Setup, checkpoints: Checkpoints, live: Liveness) -> None:
        self.ctx, self.setup, self.checkpoints, self.live = ctx, setup, checkpoints, live
        self.recoveries = 0
        self.replans = 0

    async def handle(self, run: Run, exc: WorkerLost | Replan | Evict) -> Run:
        """The next plan of a grouping of one group, after ``exc``: ``recover``, ``replan`` or ``evict``."""
        if isinstance(exc, WorkerLost):
            return await self.recover(run, exc)
        if isinstance(exc, Replan):
            return await self.replan(run, exc)
        return await self.evict(run, exc)

    async def replan(self, run: Run, again: Replan) -> Run:
        """Plan again with the links as measured, carrying the current weights and AdamW state over."""
        began = time.perf_counter()
        self.replans += 1
        self.ctx.say(f"re-planning: {again.why}")
        states = list((await self.live.guard(run, self.checkpoints.stage_states(run))).values())
        self.setup.measured = measured_links(run)
        await self.leave(run, set())
        old = run.plan.meta.get("predicted_step_s")
        run = await self.setup.setup(carry=(states, again.next_step))
        event = {"event": "replan", "why": again.why, "at_step": again.next_step, "seconds": round(time.perf_counter() - began, 3),
                 "old_predicted_step_s": old, "predicted_step_s": run.plan.meta.get("predicted_step_s"),
                 "stages": len(run.plan.stages), "workers": sorted(run.plan.workers)}
        self.record(event)
        self.ctx.say(f"re-planned in {event['seconds']:.1f} s: {len(run.plan.stages)} stages on workers {event['workers']}")
        return run

    async def recover(self, run: Run, lost: WorkerLost) -> Run:
        """Re-plan on the workers left (and spares that joined), from the newest complete checkpoint."""
        c, membership = self.ctx.cluster, self.ctx.membership
        began = time.perf_counter()
        self.recoveries += 1
        if self.recoveries > c.max_recoveries:
            raise FusionError(f"{lost}; gave up after {c.max_recoveries} recoveries")
        self.ctx.say(f"lost worker(s) {sorted(lost.workers)} ({lost.why}); re-planning on the others")
        survivors = [w for w in run.plan.workers if w not in lost.workers]
        gone = set(lost.workers) | await self.live.abort(run, survivors)
        await self.leave(run, gone)
        if not membership.members:
            raise FusionError(f"{lost}; no worker is left")
        membership.renumber()
        run = await self.setup.setup(recover=True)
        event = {"event": "recovery", "lost": sorted(gone), "workers": len(membership.members), "resumed_from_step": self.ctx.clock.start_step,
                 "seconds": round(time.perf_counter() - began, 3), "why": lost.why}
        self.record(event)
        self.ctx.say(f"recovered in {event['seconds']:.1f} s: {event['workers']} workers, continuing from step {self.ctx.clock.start_step}")
        return run

    async def evict(self, run: Run, ev: Evict) -> Run:
        """Plan again without the evicted workers, carrying the live weights and AdamW state of each
        stage from a worker that stays (from the evicted one where it held a stage alone: its weights
        only ever took verified updates)."""
        membership = self.ctx.membership
        began = time.perf_counter()
        left = [w for w in run.plan.workers if w not in ev.workers]
        if not left and not any(w not in ev.workers for w in membership.members):
            raise FusionError(f"{ev}; no worker would be left")
        self.ctx.say(f"evicting worker(s) {sorted(ev.workers)}: {ev.why}")
        sources = {s.index: next((w for w in s.workers if w not in ev.workers), s.workers[0]) for s in run.plan.stages}
        states = [await self.live.guard(run, self.checkpoints.read_state(run, w)) for _, w in sorted(sources.items())]
        addresses = await self.send_away(run, ev.workers)
        await self.leave(run, set(ev.workers))
        membership.renumber()
        run = await self.setup.setup(carry=(states, ev.next_step))
        event = evict_event(ev, addresses, time.perf_counter() - began, workers_left=len(membership.members))
        self.record(event)
        self.ctx.say(f"evicted in {event['seconds']:.1f} s: {event['workers_left']} workers, step {ev.next_step} runs again on the new plan")
        return run

    async def send_away(self, run: Run, workers: set[int]) -> dict[int, str]:
        """Tell evicted workers to leave (they would otherwise join again as spares); their addresses."""
        members = self.ctx.membership.members
        addresses = {w: members[w].address for w in workers if w in members}
        for w in workers:
            with contextlib.suppress(FusionError):
                await run.clients[w].call("Shutdown", {}, timeout=5)
        return addresses

    async def leave(self, run: Run, lost: set[int]) -> None:
        """Drop a plan before making the next one: its clients, lost workers; a new epoch."""
        for client in run.clients.values():
            await client.close()
        self.ctx.membership.lose(lost)
        self.ctx.clock.new_epoch()

    def record(self, event: dict[str, Any]) -> None:
        """A new plan and the event that made it, in the metrics and on the dashboard."""
        self.ctx.metrics.write(self.setup.plan_record)
        self.ctx.event(event)


def evict_event(ev: Evict, addresses: dict[int, str], seconds: float, *, workers_left: int, group: int | None = None) -> dict[str, Any]:
    """The ``evict`` record, the same for a synchronous run and a group of several."""
    event: dict[str, Any] = {"event": "evict", "workers": sorted(ev.workers), "addresses": {str(k): v for k, v in addresses.items()},
                             "why": ev.why, "at_step": ev.next_step, "seconds": round(seconds, 3), "workers_left": workers_left}
    if group is not None:
        event["group"] = group
    return event
