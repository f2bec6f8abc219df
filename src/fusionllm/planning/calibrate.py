"""Predictions calibrated online: the cost model's device speeds fitted to the steps a plan ran.

The planner predicts a step once, from probed device speeds and op times measured on the
coordinator; on a shared machine a core's speed moves 70-160 GFLOP/s between runs, and predictions
were 20-50% off (a one-device plan predicted 0.164 s a step and ran 0.29-0.34 s). So once a plan has
run a few steps (``WARMUP_STEPS`` skipped: connections open, caches warm), its steps are the
measurement the cost model is fitted to (``fit``):

1. each CPU worker's speed: the CPU work the simulator gives it per step over the CPU seconds it
   spent (the step records' ``cpu_s``, the worker process's time): a device that needs twice the
   CPU for the same work runs at half the modelled speed. It is a device's own figure, so a re-plan
   that moves stages keeps it (``cost.model.calibrated_hardware``).
2. the per-step wall time beyond the actions (the coordinator's round trip, wake-ups, waits the
   simulator does not see): the rest of the measured step, as the cost model's ``step_overhead_s``.
3. where that rest would be negative (the model too slow even without overhead), or no worker has
   CPU figures (an accelerator's host CPU says nothing of its kernels): every device's speed times
   one factor, the least (found by bisection) whose simulated step is no longer than the measured
   one; what is left (a quota's periods make the step jump with speed) goes into the overhead.

The fitted model predicts the running plan's step to the mean of its measured steps (``typical``:
the time to a target is their sum; a step over ``STALL`` times the median, a pause the step did not
cause, is left out), not their median: on a shared machine a plan's steps have a long tail (random:41's
dp plan, steps 20-60: median 0.385 s, mean 0.399 s), and a median-fitted prediction was 4-14% short of
the run's time. Every later plan is made with the fitted speeds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from fusionllm.cost.model import CostModel
from fusionllm.schedule.plan import Plan, Request
from fusionllm.sim.simulator import simulate

WARMUP_STEPS = 5  # a plan's first steps open connections and warm caches: not measured
FIT_AFTER = 10  # measured steps before the first fit (the 15th step of a plan)
REFIT_EVERY = 20  # and again every so many measured steps, on the last so many (speeds move)
STEADY = 1.5  # a window whose halves' median steps differ by more than this factor is not fitted (``Samples.due``)
SPEED_RANGE = (0.02, 50.0)  # a fitted speed factor stays within these (a stalled step is no speed)
BISECTIONS = 24
STALL = 3.0  # a step this many times the window's median is a stall (a pause, a re-plan), not the plan's pace


def typical(walls: list[float]) -> float:
    """The step time a fit matches: the mean of ``walls`` without stalls (``STALL``)."""
    median = statistics.median(walls)
    return statistics.fmean(w for w in walls if w <= STALL * median)


@dataclass(frozen=True)
class Sample:
    """One measured step: its wall seconds and each worker's CPU seconds in it."""

    wall_s: float
    cpu_s: dict[int, float] = field(default_factory=dict)


class Samples:
    """A plan's measured steps, from its step records (whose ``elapsed_s`` and ``cpu_s`` are totals
    so far): the first ``warmup`` are skipped."""

    def __init__(self, warmup: int = WARMUP_STEPS) -> None:
        self.warmup, self.seen = warmup, 0
        self.items: list[Sample] = []
        self.last_cpu: dict[int, float] = {}
        self.last_elapsed: float | None = None
        self.fitted_at = 0  # len(items) at the last fit

    def add(self, *, step_s: float, cpu_s: Mapping[str, float] | Mapping[int, float], elapsed_s: float | None = None) -> None:
        """One step record's figures; ``elapsed_s`` (the run's training seconds so far, one group):
        its wall time is the difference from the last record's, the coordinator's round trip
        included; without it (several groups share the clock), the slowest worker's ``step_s``."""
        cpu = {int(w): float(v) for w, v in cpu_s.items()}
        spent = {w: v - self.last_cpu[w] for w, v in cpu.items() if w in self.last_cpu and v >= self.last_cpu[w]}
        wall = elapsed_s - self.last_elapsed if elapsed_s is not None and self.last_elapsed is not None else step_s
        self.seen += 1
        if self.seen > self.warmup and wall > 0:
            self.items.append(Sample(wall, spent))
        self.last_cpu, self.last_elapsed = cpu, elapsed_s

    def due(self) -> bool:
        """Whether to fit now: ``FIT_AFTER`` measured steps, then every ``REFIT_EVERY``, on a steady
        window only: a window whose later half's median step is ``STEADY`` times its earlier half's
        (or less than 1/``STEADY``) holds a change (a choked link, a lost core) that the re-plan rule
        must see against the prediction, not a fit that absorbs it; the fit waits until it settles."""
        n = len(self.items)
        if n < FIT_AFTER or (self.fitted_at != 0 and n - self.fitted_at < REFIT_EVERY):
            return False
        window = [x.wall_s for x in self.items[-REFIT_EVERY:]]
        half = len(window) // 2
        early, late = statistics.median(window[:half]), statistics.median(window[half:])
        return late <= STEADY * early and early <= STEADY * late

    def recent(self) -> list[Sample]:
        """The measured steps a fit reads: the last ``REFIT_EVERY``."""
        self.fitted_at = len(self.items)
        return self.items[-REFIT_EVERY:]


@dataclass(frozen=True)
class Calibration:
    """A fit: per device (hardware index), its speed over the modelled one; the per-step overhead;
    the running plan's step as predicted before and after, and as measured (``typical``)."""

    speed: dict[int, float]
    step_overhead_s: float
    before_s: float
    after_s: float
    measured_s: float
    steps: int

    @property
    def error_before(self) -> float:
        return self.before_s / self.measured_s - 1.0

    @property
    def error_after(self) -> float:
        return self.after_s / self.measured_s - 1.0

    def to_json(self) -> dict[str, object]:
        return {"predicted_step_s_before": round(self.before_s, 4), "predicted_step_s": round(self.after_s, 4),
                "measured_step_s": round(self.measured_s, 4), "steps": self.steps, "step_overhead_s": round(self.step_overhead_s, 5),
                "speed": {str(w): round(f, 4) for w, f in sorted(self.speed.items())}}


def predicted(plan: Plan, cost: CostModel, req: Request, speed: Mapping[int, float], step_overhead_s: float) -> float:
    """``plan``'s step predicted with fitted speeds and overhead (a plan made after a fit, before its own)."""
    return simulate(plan, cost.calibrated(speed, step_overhead_s), req).step_time_s


def _clamp(f: float) -> float:
    return min(max(f, SPEED_RANGE[0]), SPEED_RANGE[1])


def fit(plan: Plan, cost: CostModel, req: Request, samples: list[Sample]) -> Calibration:
    """The cost model fitted to ``samples`` of ``plan``'s steps (module docstring); ``cost`` is the
    uncalibrated model (speed factors are measured against it)."""
    if not samples:
        raise ValueError("no measured steps to calibrate with")
    measured = typical([s.wall_s for s in samples])
    before = simulate(plan, cost, req)
    speed: dict[int, float] = {}
    for w in plan.workers:
        device = cost.hw.devices[w]
        spent = [s.cpu_s[w] for s in samples if s.cpu_s.get(w, 0.0) > 0]
        work = before.cpu_s.get(w, 0.0) * max(1.0, device.cpus or 1.0)  # the simulator counts CPU at the device's speed
        if device.flops or len(spent) * 2 < len(samples) or work <= 0:
            continue
        speed[w] = _clamp(work / statistics.median(spent))

    def step_at(factor: float, overhead: float) -> float:
        return simulate(plan, cost.calibrated({w: _clamp(speed.get(w, 1.0) * factor) for w in plan.workers}, overhead), req).step_time_s

    overhead = cost.step_overhead_s
    factor = 1.0
    if speed:
        overhead = max(0.0, overhead + measured - step_at(1.0, overhead))
    if not speed or step_at(1.0, overhead) > measured * 1.001:
        factor = _bisect(lambda f: step_at(f, overhead) - measured)
    # the rest as overhead: a quota's 100 ms periods make the step jump with speed, and a step bound by links does not move
    overhead = max(0.0, overhead + measured - step_at(factor, overhead))
    final = {w: _clamp(speed.get(w, 1.0) * factor) for w in plan.workers}
    after = simulate(plan, cost.calibrated(final, overhead), req).step_time_s
    return Calibration(final, overhead, before.step_time_s, after, measured, len(samples))


def _bisect(gap: Callable[[float], float]) -> float:
    """The least speed factor whose step is no longer than measured (``gap``: simulated minus
    measured, falling with speed; it may jump where a quota's period no longer holds an action), in
    log space within ``SPEED_RANGE``; the range's end where there is none (a step bound by links)."""
    lo, hi = math.log(SPEED_RANGE[0]), math.log(SPEED_RANGE[1])
    if gap(math.exp(hi)) > 0:
        return math.exp(hi)
    if gap(math.exp(lo)) <= 0:
        return math.exp(lo)
    for _ in range(BISECTIONS):
        mid = (lo + hi) / 2
        if gap(math.exp(mid)) > 0:
            lo = mid
        else:
            hi = mid
    return math.exp(hi)
