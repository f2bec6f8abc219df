"""Utilization: the fraction of the cluster's aggregate compute that does useful training work (0-1).

    utilization = sum over ALL devices d of busy_d * speed_d  /  sum over all devices d of speed_d

where ``busy_d`` is the fraction of wall time device ``d`` spends on training compute (0 for a device
no plan uses) and ``speed_d`` is how much of this model's work the device does per second: the
inverse of its forward + backward seconds for the whole model on one micro-batch under sustained
load (``CostModel.op_vector``; for accelerators that is their FLOP/s at the cost model's efficiency,
for CPU shares their quota). Synchronous and hierarchical plans compare on this one number.

Training compute is what the simulator counts as a device's busy time (``SimResult.busy_s``: its
forward and backward actions, a CPU share's quota stalls inside them included) plus its optimizer
step over its own parameters (AdamW; the runtime's per-step CPU, ``step_cpu_s``, is left out).
Codec CPU time, message handling, pipeline bubbles, all-reduce waits and waits for the outer
exchange are not useful work: they count 0.
"""

from __future__ import annotations

from collections.abc import Mapping

from fusionllm.cluster.hardware import Device
from fusionllm.cost.model import CostModel
from fusionllm.schedule.plan import Plan


def device_speed(cost: CostModel, device: Device) -> float:
    """Work per second on this model: 1 / (forward + backward seconds of every op, one micro-batch)."""
    total = float(cost.op_vector(device).sum())
    return 1.0 / total if total > 0 else 0.0


def optimizer_busy_s(cost: CostModel, plan: Plan) -> dict[int, float]:
    """Seconds of each worker's AdamW step over its stage's parameters (wall time under its quota)."""
    graph = cost.graph
    out: dict[int, float] = {}
    for s in plan.stages:
        nbytes = sum(graph.params[p].meta.nbytes for p in plan.stage_params(graph, s.index))
        for w in s.workers:
            dev = cost.hw.devices[w]
            if dev.flops:
                out[w] = out.get(w, 0.0) + cost.optimizer_seconds(nbytes, dev)
            else:
                out[w] = out.get(w, 0.0) + nbytes / cost.optimizer_bytes_per_s / cost.cpu_rate(dev)
    return out


def useful_busy_s(cost: CostModel, plan: Plan, busy_s: Mapping[int, float]) -> dict[int, float]:
    """Training compute seconds per step of each worker of ``plan``: forward/backward + its optimizer."""
    opt = optimizer_busy_s(cost, plan)
    return {w: busy_s.get(w, 0.0) + opt.get(w, 0.0) for w in plan.workers}


def device_busy(busy_s: Mapping[int, float], wall_s: float, n_devices: int) -> dict[int, float]:
    """Fraction of wall time each device of the cluster computes (0 for the ones not in ``busy_s``)."""
    if wall_s <= 0:
        return dict.fromkeys(range(n_devices), 0.0)
    return {d: min(1.0, busy_s.get(d, 0.0) / wall_s) for d in range(n_devices)}


def utilization(busy_fraction: Mapping[int, float], cost: CostModel) -> float:
    """Speed-weighted mean of every device's busy fraction (see the module docstring)."""
    speeds = {i: device_speed(cost, d) for i, d in enumerate(cost.hw.devices)}  # by position: a subset's devices keep their index
    total = sum(speeds.values())
    if total <= 0:
        return 0.0
    return sum(busy_fraction.get(i, 0.0) * s for i, s in speeds.items()) / total


def sync_utilization(plan: Plan, cost: CostModel, busy_s: Mapping[int, float], step_s: float) -> tuple[float, dict[int, float]]:
    """A synchronous plan's utilization and every device's busy fraction, from one simulated step
    (``busy_s`` and ``step_s`` of ``SimResult``; ``cost``'s hardware is the whole cluster)."""
    frac = device_busy(useful_busy_s(cost, plan, busy_s), step_s, len(cost.hw))
    return utilization(frac, cost), frac
