"""A plan as people and readers see it: the lines printed when it starts, and its metrics record.

The same record goes to the metrics file (``fusionllm report``) and to the dashboard.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .capabilities import backend_of
from .collectives import carried_links
from .config import Run
from .status import stage_rows


def plan_lines(run: Run, addresses: dict[int, str], members: Mapping[int, Any]) -> list[str]:
    """What the coordinator says about a plan it starts: stages, their workers and devices, worlds."""
    lines = [f"plan: {len(run.plan.stages)} stages, schedule {run.plan.schedule}, {run.plan.micro_batches} micro-batches per step"]
    for w in sorted(set(addresses) - set(run.plan.workers)):
        lines.append(f"  worker {w} ({addresses[w]}): idle (the plan is faster without it)")
    for s in run.plan.stages:
        nodes = [run.graph.node(n) for n in s.nodes]
        params = sum(run.graph.params[p].meta.numel for p in run.plan.stage_params(run.graph, s.index))
        names = [n.name for n in nodes if not n.kind.startswith(("method", "function", "property"))]
        shown = ", ".join(names[:4]) + (f" +{len(names) - 4}" if len(names) > 4 else "")
        for w in s.workers:
            dev = members[w].info.describe()
            lines.append(f"  worker {w} ({dev} @ {addresses[w]}): stage {s.index}, {len(nodes)} ops, {params:,} params [{shown}]")
    for world in run.worlds:
        lines.append(f"  {world.line()}")
    return lines


def plan_event(run: Run, addresses: dict[int, str], members: Mapping[int, Any], cost: Any, *, epoch: int, scheduler: str | None) -> dict[str, Any]:
    """The plan as a metrics record (and for the dashboard): stages, workers, links."""
    plan = run.plan
    stages = stage_rows(run.graph, plan)
    hw = getattr(cost, "hw", None)
    workers = {}
    for w, m in members.items():
        workers[str(w)] = {"address": addresses.get(w, m.address), "backend": backend_of(m.info), "device": m.info.device.kind,
                           "software": dict(m.info.software),
                           "site": hw.devices[w].site if hw is not None and w < len(hw) else None, "in_plan": w in plan.workers,
                           "relay": m.info.relay or None}
    bandwidth = {}
    if hw is not None:
        bandwidth = {f"w{a}->w{b}": hw.bps(a, b) for a in range(len(hw)) for b in range(len(hw)) if a != b and math.isfinite(hw.bps(a, b))}
    return {"event": "plan", "epoch": epoch, "scheduler": plan.meta.get("scheduler") or scheduler, "schedule": plan.schedule,
            "micro_batches": plan.micro_batches, "predicted_step_s": plan.meta.get("predicted_step_s"), "stages": stages,
            "workers": workers, "bandwidth_bps": bandwidth, "collectives": [world.record() for world in run.worlds],
            "carried": [f"w{a}->w{b}" for a, b in sorted(carried_links(run.worlds))]}
