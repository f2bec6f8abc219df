"""Bad steps: what the coordinator does when the workers' numeric guards refused a tensor.

The workers have already made sure that nobody applied the step (``runtime/guards.py``). Here the
coordinator names the suspect (the sender of each refused tensor), counts strikes against it (by
its address, which outlives a renumbering), and follows ``--numeric-guard``:

- ``retry``: run the step once more from the same state (same batch, same learning rate, same
  dropout masks); a second bad attempt skips the step (its batch is not used, the next step
  follows). A worker blamed ``--evict-after`` times within ``STRIKE_WINDOW`` steps is evicted: the
  run is planned again without it, from the live weights of the others (``Evict``), and the step
  runs on the new plan. Older strikes are forgotten: a healthy run can meet a genuine spike that
  the guard refuses (two strikes: the attempt and its retry, docs/reliability.md), and a second one
  hundreds of steps later must not evict a healthy worker; a failing device keeps failing.
- ``stop``: the run ends with an error naming the worker.

Every bad attempt is a metrics event ``{"event": "bad_step", ...}`` naming the suspects.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from fusionllm.core.errors import FusionError
from fusionllm.core.metrics import JsonlWriter
from fusionllm.transport.control import StepDone

from .config import Evict, Run

STRIKE_WINDOW = 200  # steps a strike counts for

class BadStepMixin:
    """The coordinator's numeric-guard half (``Coordinator`` mixes it in)."""

    def _bad_step(self, run: Run, step: int, attempt: int, replies: dict[int, StepDone], metrics: JsonlWriter) -> int:
        """Record a bad attempt of ``step`` and decide: the next attempt's number, or -1 to skip the step."""
        c = self.cluster
        if not all(rep.skipped for rep in replies.values()):
            applied = sorted(w for w, rep in replies.items() if not rep.skipped)
            raise FusionError(f"step {step}: workers {applied} applied a step others refused; the stages have diverged (resume from a checkpoint)")
        bad = [b for rep in replies.values() for b in rep.bad]
        named = sorted({b.suspect for b in bad})
        strikes = self.strikes
        for w in named:
            address = self.membership.members[w].address if w in self.membership.members else f"worker {w}"
            strikes[address] = [s for s in strikes.get(address, []) if s > step - STRIKE_WINDOW] + [step]
        why = "; ".join(sorted({f"{b.kind} {b.edge} from worker {b.suspect}: {b.why}" for b in bad})) or "the gradient norm is not finite"
        event: dict[str, Any] = {
            "event": "bad_step", "step": step, "attempt": attempt, "suspects": named,
            "addresses": {str(w): self.membership.members[w].address for w in named if w in self.membership.members},
            "strikes": {str(w): len(strikes.get(self.membership.members[w].address, [])) for w in named if w in self.membership.members},
            "bad": [{"suspect": b.suspect, "detector": b.detector, "kind": b.kind, "edge": b.edge, "mb": b.mb, "why": b.why} for b in bad],
        }
        evict = {w for w in named if c.evict_after and event["strikes"].get(str(w), 0) >= c.evict_after}
        if c.guard == "stop":
            event["action"] = "stop"
        elif evict:
            event["action"] = "evict"
        else:
            event["action"] = "retry" if attempt == 0 else "skip"
        metrics.write(event)
        self.status.event(event)
        who = f"worker(s) {named}" if named else "no single worker"
        if event["action"] == "stop":
            raise FusionError(f"step {step}: a bad tensor ({why}); blamed: {who}. Stopped (--numeric-guard stop); "
                              f"--numeric-guard retry skips such steps and evicts a worker that keeps sending them")
        if event["action"] == "evict":
            raise Evict(evict, f"{len(evict) and max(event['strikes'][str(w)] for w in evict)} bad tensors ({why})", step)
        self.say(f"step {step} attempt {attempt + 1}: bad tensor ({why}); blamed: {who}; "
                 + ("running it again" if event["action"] == "retry" else "skipping the step"))
        return 1 if event["action"] == "retry" else -1

    async def _evict(self, run: Run, ev: Evict, metrics: JsonlWriter) -> Run:
        """Plan again without the evicted workers, carrying the live weights and AdamW state of each
        stage from a worker that stays (from the evicted one where it held a stage alone: its weights
        only ever took verified updates)."""
        began = time.perf_counter()
        left = [w for w in run.plan.workers if w not in ev.workers]
        if not left and not any(w not in ev.workers for w in self.membership.members):
            raise FusionError(f"{ev}; no worker would be left")
        self.say(f"evicting worker(s) {sorted(ev.workers)}: {ev.why}")
        sources = {s.index: next((w for w in s.workers if w not in ev.workers), s.workers[0]) for s in run.plan.stages}
        states = [await self._guard(run, self._read_state(run, w)) for _, w in sorted(sources.items())]
        addresses = {w: self.membership.members[w].address for w in ev.workers if w in self.membership.members}
        for w in ev.workers:  # an evicted worker leaves the run (it would otherwise join again as a spare)
            with contextlib.suppress(FusionError):
                await run.clients[w].call("Shutdown", {}, timeout=5)
        await self._leave(run, set(ev.workers))
        self.membership.renumber()
        run = await self._setup(carry=(states, ev.next_step))
        event = {"event": "evict", "workers": sorted(ev.workers), "addresses": {str(k): v for k, v in addresses.items()}, "why": ev.why,
                 "at_step": ev.next_step, "seconds": round(time.perf_counter() - began, 3), "workers_left": len(self.membership.members)}
        self._record(metrics, event)
        self.say(f"evicted in {event['seconds']:.1f} s: {event['workers_left']} workers, step {ev.next_step} runs again on the new plan")
        return run
