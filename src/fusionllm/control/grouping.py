"""The run's groupings, and the one place where the planner's grouping is chosen.

A run is a list of groupings (``--sync``, ``--groups``, ``--regroup``): steps ``first`` to ``last``
trained by one group (synchronous) or by several. Where the planner forms the groups (``--sync
hierarchical`` without ``--groups``, ``--sync auto``, and the rest of a grouping a re-plan ended),
``choose`` asks it once, before anything is set up, and the answer is a grouping like any other:
one group, or several with the planner's ``HierPlan`` (``planning.hierarchy.choose_hier_plan``;
``--sync auto`` lets it answer one group). Nothing switches mode later: a run changes grouping only
by a regroup at a pause (``phases.py``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import Any

from fusionllm.planning.finalists import Finalist, alone, left_out
from fusionllm.transport.control import WORKER_SERVICE
from fusionllm.transport.rpc import RpcClient

from .context import RunContext
from .hier_setup import GroupSetup


@dataclass(frozen=True)
class Grouping:
    """Steps ``first`` to ``last`` trained as one group (``groups`` None) or several (``groups``: by
    hand or chosen; ``[]``: the planner's, not chosen yet). ``hier``: the planner's plan of them,
    once chosen (``choose``)."""

    first: int
    last: int
    groups: list[list[int]] | None
    replanned: bool = False  # the rest of a grouping a re-plan ended early (not a regroup)
    hier: Any = field(default=None, compare=False)  # schedule.hierarchy.HierPlan
    candidates: list[Finalist] = field(default_factory=list, compare=False)  # the planner's, when it chose (--sync auto)
    trial: Finalist | None = field(default=None, compare=False)  # a finalist measured for these steps (control/finalists.py)
    decide: tuple[Finalist, ...] = field(default=(), compare=False)  # not chosen yet: the best of these measured finalists
    committed: Finalist | None = field(default=None, compare=False)  # the finalist the run committed to

    @property
    def chosen(self) -> bool:
        """Whether the groups are known (by hand, or the planner's choice)."""
        return self.groups != []

    def describe(self) -> str:
        if self.groups is None:
            return "one group (synchronous)"
        return f"{len(self.groups)} groups {'/'.join(','.join(map(str, g)) for g in self.groups)}" if self.groups else "the planner's groups"


def groupings(sync: str, groups: list[list[int]] | None, regroup: list[tuple[int, list[list[int]]]] | None, steps: int) -> list[Grouping]:
    """The run's groupings in order (``--sync``, ``--groups``, ``--regroup``); regroups at or past
    ``steps`` are dropped."""
    starts: list[tuple[int, list[list[int]] | None]] = [(0, None if sync == "synchronous" else (groups or []))]
    for step, grouping in regroup or []:
        if step < steps:
            starts.append((int(step), None if len(grouping) == 1 else [list(g) for g in grouping]))
    ends = [s for s, _ in starts[1:]] + [steps]
    return [Grouping(first, last, g) for (first, g), last in zip(starts, ends, strict=True)]


async def choose(ctx: RunContext, group_setup: GroupSetup, grouping: Grouping) -> Grouping:
    """``grouping`` with the planner's groups chosen (unchanged when they are known already): one
    group (``--sync auto`` only) or several, with their ``HierPlan``. The planner sees the members
    as they are now, and plans for the grouping's steps (no H beyond them)."""
    c = ctx.cluster
    if grouping.chosen or not c.scheduler:  # (without a planner, the set-up names what is missing)
        return grouping
    graph = await asyncio.to_thread(ctx.task.trace, group_setup.group_batch() // c.micro_batches)  # as the set-up traces it
    addresses = {m.id: m.address for m in ctx.membership.members.values()}
    clients = {w: RpcClient(a, WORKER_SERVICE, c.token, tls=c.tls, incarnation=ctx.membership.incarnation) for w, a in addresses.items()}
    kept: list[tuple[Any, dict[str, Any]]] = []
    try:
        hier = await group_setup.schedule(graph, clients, grouping.last - grouping.first, kept)
        hw = await group_setup.setup.hardware(clients) if c.sync == "auto" and c.finalists >= 2 else None  # (the fastest device alone)
    finally:
        for client in clients.values():
            await client.close()
    candidates = [f for h, cand in kept if (f := finalist(h, cand)) is not None] if c.sync == "auto" else []
    solo = fastest_alone(hw, candidates) if hw is not None else None
    sync = next((h for h, cand in kept if cand["grouping"] == "synchronous"), None)
    if solo is not None and not (sync is not None and [list(g.workers) for g in sync.groups] == solo.groups
                                 and sync.groups[0].plan.micro_batches == 1):  # (not where the synchronous plan is that already)
        candidates.append(solo)
    if c.sync == "auto":
        auto_event(ctx, hier, grouping.first)
    if len(hier.groups) == 1 and c.sync == "auto":  # one synchronous group is predicted to reach a target loss first
        return replace(grouping, groups=None, candidates=candidates)
    reasons = left_out(hier.meta.get("unused_devices", []), hier.meta.get("grouping", ""), hier.meta.get("candidates", []))
    if reasons:  # no device is left out of every group without a reason (issue 58: one of the two fastest was, silently)
        hier.meta["left_out"] = {str(d): why for d, why in reasons.items()}
        ctx.event({"event": "left_out", "at_step": grouping.first, "devices": hier.meta["left_out"]})
        for d, why in reasons.items():
            ctx.say(f"worker {d} is in no group: {why}")
    return replace(grouping, groups=[list(g.workers) for g in hier.groups], hier=hier, candidates=candidates)


def finalist(hier: Any, candidate: dict[str, Any]) -> Finalist | None:
    """A candidate of the planner (its plan and its figures) as a finalist the run can measure: the
    synchronous plan, or groups with their ``HierPlan``; None for one group of some devices only."""
    name, tokens, eff = candidate["grouping"], candidate["tokens_per_s"], candidate["efficiency"]
    if candidate["groups"] == 1:
        return Finalist(name, "synchronous", None, tokens, eff) if name == "synchronous" else None
    return Finalist(name, "groups", [list(g.workers) for g in hier.groups], tokens, eff, max(g.inner_steps for g in hier.groups), hier)


def fastest_alone(hw: Any, candidates: list[Finalist]) -> Finalist:
    """The fastest device of ``hw`` alone, as a finalist (``planning/finalists.alone``)."""
    def speed(d: Any) -> float:
        return float(d.flops) if d.flops else float(d.cpus or 1.0) * d.speed

    best = max(hw.devices, key=speed)
    sync = next((f.predicted_tokens_per_s for f in candidates if f.kind == "synchronous"), 0.0)
    return alone(best.index, speed(best), sum(speed(d) for d in hw.devices), sync)


def auto_event(ctx: RunContext, hier: Any, at_step: int) -> None:
    """What ``--sync auto`` chose at ``at_step`` and why (the planner's candidates), said and recorded."""
    meta = hier.meta
    ctx.event({"event": "auto", "at_step": at_step, "chose": meta.get("grouping"), "groups": len(hier.groups),
               "tokens_per_s": meta.get("tokens_per_s", 0.0), "efficiency": meta.get("efficiency", 1.0),
               "candidates": [{k: c.get(k) for k in ("grouping", "groups", "group_batch", "tokens_per_s", "efficiency", "time_to_target")}
                              for c in meta.get("candidates", [])]})
    ctx.say(f"--sync auto: {meta.get('grouping')} ({len(hier.groups)} group{'s' if len(hier.groups) != 1 else ''}) is predicted to reach "
            f"a target loss first: " + ", ".join(f"{c['grouping']} {c['time_to_target']:.2f}x" for c in meta.get("candidates", [])))
