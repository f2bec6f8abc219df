"""From a cluster to a hierarchical plan: replica groups, their synchronous plans, H, fragments, codecs.

The planner tries a few groupings of the devices (``candidate groupings`` below). A grouping of M
groups keeps the run's global batch: each group trains ``group_rows(batch, M)`` rows an inner step
(``--group-batch`` by hand). Every group gets the synchronous planner's plan for its own devices at
that batch (``choose_plan`` on ``hw.subset``); for each H of ``GOODPUT_H`` the codecs are, among
those whose traffic between groups hides behind the round, the one of the best measured per-token
efficiency (``planning.efficiency.outer_codec_candidates``: q4 and better first, then top-k with error
feedback; none hides: the fewest bytes, and the groups wait), the round simulator (``sim/rounds.py``)
predicts tokens/s, and ``planning.efficiency`` the per-token efficiency of M groups at that H with
that codec (over a slow link top-k lets groups sync every 1-4 steps, where q4 needs many more). The planner keeps the grouping and H with the most *goodput* (tokens/s times
efficiency: the first to reach a target loss; ties within 1% to fewer groups). Everything it
predicts goes into ``HierPlan.meta``, every candidate's predicted time to a target against the
chosen one's included; docs/scheduler.md, "Hierarchical mode" and "Time to target", explains the rules.

Candidate groupings (each group must hold the whole model; a group with no plan that fits is
dropped and its devices stay idle):

- ``synchronous``: one group of every device, that is today's synchronous plan; always a candidate,
  so the hierarchical plan is never predicted slower than the synchronous one;
- ``fences``: one group per fence (``planning.fences.find_fences``);
- ``fences, idle devices regrouped``: in each fence, the devices its plan leaves idle form further
  groups (planned again, or, where they look exactly like the devices a plan used, given the same
  plan), so a fence of eight GPUs whose best plan is one GPU becomes eight groups;
- ``single devices``: every device that holds the model alone is a group of its own (DiLoCo's
  usual shape); in each fence the devices that cannot are grouped as above;
- ``merged fences``: two groups merge when their joint synchronous plan has at least the tokens/s of
  the two apart (a merge then costs no throughput and saves traffic and DiLoCo's loss of per-token
  efficiency), tried greedily over the fastest links between them; then regrouped as above.

The efficiency model is fitted on small models and short runs, where groups lose the most per token
(``planning/efficiency.py``): it errs towards one synchronous group.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from fusionllm.cluster.hardware import Hardware
from fusionllm.compress.codecs import parse_codec
from fusionllm.core.errors import ConfigError, FusionError
from fusionllm.cost.model import CostModel
from fusionllm.cost.work import OpWork
from fusionllm.graph.ir import OpGraph
from fusionllm.planning.choose import choose_plan
from fusionllm.planning.efficiency import (
    codec_efficiency,
    group_efficiency,
    mean_inner_steps,
    outer_codec_candidates,
)
from fusionllm.planning.fences import fence_link, find_fences
from fusionllm.planning.inner_steps import (
    GOODPUT_H,
    MAX_INNER_STEPS,
    MIN_INNER_STEPS,
    PREFERRED_CODEC,
    _Choice,
    alone_rounds,
    choose_inner_steps,
)
from fusionllm.planning.schedulers import device_speed
from fusionllm.schedule.hierarchy import (
    GroupPlan,
    HierPlan,
    group_rows,
    micro_batches_for,
    param_fragments,
    remap,
)
from fusionllm.schedule.plan import Plan, Request
from fusionllm.sim.rounds import (
    GroupStep,
    RoundResult,
    Traffic,
    codec_ratio,
    group_step,
    round_traffic,
    simulate_rounds,
)

MAX_GROUPS = 64  # groups per plan: the exchange is all-to-all between groups
MAX_PLANNINGS = 24  # synchronous plannings of distinct device sets per grouping search (cache misses)
MAX_MERGE_TRIES = 4
TIE = 0.01  # candidates within 1% of the best goodput: the one with fewer groups wins


@dataclass
class _Group:
    plan: Plan  # global worker ids
    step: GroupStep  # global worker ids

    @property
    def workers(self) -> list[int]:
        return self.plan.workers

    @property
    def tokens_per_step_s(self) -> float:
        return 1.0 / self.step.step_s


class _Planner:
    """Synchronous plans of device sets, cached by what the devices look like (same speeds, memory,
    links and latencies in the same order: the same plan, relabelled)."""

    def __init__(self, graph: OpGraph, hw: Hardware, scheduler: str, req: Request, work: dict[str, OpWork],
                 compress: str, place: Callable[[Plan], Plan] | None) -> None:
        self.graph, self.hw, self.scheduler, self.req, self.work = graph, hw, scheduler, req, work
        self.compress, self.place = compress, place
        self.cache: dict[Any, tuple[Plan, GroupStep] | None] = {}
        self.plannings = 0

    def order(self, ids: list[int]) -> list[int]:
        return sorted(ids, key=lambda i: (-device_speed(self.hw.devices[i]), i))

    def signature(self, ids: list[int]) -> Any:
        if self.place is not None:  # capabilities differ per worker: no sharing
            return tuple(ids)
        hw = self.hw
        return (tuple((hw.devices[i].cpus, hw.devices[i].flops, hw.devices[i].memory, hw.devices[i].speed) for i in ids),
                tuple(hw.bandwidth[i][j] for i in ids for j in ids), tuple(hw.latency[i][j] for i in ids for j in ids))

    def plan(self, ids: list[int]) -> _Group | None:
        """The synchronous planner's plan over ``ids`` (ordered), or None when none fits or the planning budget is spent."""
        ids = self.order(ids)
        key = self.signature(ids)
        if key not in self.cache:
            if self.plannings >= MAX_PLANNINGS:
                return None
            self.plannings += 1
            self.cache[key] = self._plan_local(ids)
        found = self.cache[key]
        if found is None:
            return None
        local, step = found
        return _Group(remap(local, ids), GroupStep(step.step_s, {ids[w]: b for w, b in step.busy_s.items()}))

    def relabel(self, group: _Group, ids: list[int]) -> _Group:
        """``group``'s plan on other devices that look the same (``signature``), in the same order."""
        src = self.order(group.workers)
        to = dict(zip(src, self.order(ids), strict=True))
        plan = remap(group.plan, to)
        return _Group(plan, GroupStep(group.step.step_s, {to[w]: b for w, b in group.step.busy_s.items()}))

    def _plan_local(self, ids: list[int]) -> tuple[Plan, GroupStep] | None:
        sub = _subset(self.hw, ids)
        place = None
        if self.place is not None:
            outer = self.place
            back = {g: i for i, g in enumerate(ids)}

            def place(plan: Plan) -> Plan:  # the caller's placement works on global ids
                placed = outer(remap(plan, ids))
                return _to_local(placed, back)
        try:
            plan, cost = choose_plan(self.graph, sub, self.scheduler, self.req, work=self.work, say=lambda _: None,
                                     compress=self.compress, place=place)
        except (ConfigError, FusionError):
            return None  # no plan fits these devices (memory, placement): the group is dropped
        step = group_step(plan, cost, self.req, step_s=float(plan.meta.get("predicted_step_s", 0.0)) or None)
        return plan, step

    def peel(self, ids: list[int], limit: int) -> list[_Group]:
        """Groups from ``ids``: the best plan, then the devices it leaves idle, again (at most ``limit`` groups)."""
        out: list[_Group] = []
        rest = self.order(ids)
        while rest and len(out) < limit:
            g = self.plan(rest)
            if g is None:
                break
            out.append(g)
            used = self.order(g.workers)
            rest = [i for i in rest if i not in set(used)]
            shape = self.signature(used)
            while len(rest) >= len(used) and len(out) < limit and self.signature(rest[: len(used)]) == shape:
                out.append(self.relabel(g, rest[: len(used)]))  # the same devices again: the same plan
                rest = rest[len(used):]
        return out


def _subset(hw: Hardware, ids: list[int]) -> Hardware:
    """``hw.subset(ids)`` with the devices renumbered ``0..k-1`` (OP-Fence looks devices up by their index)."""
    sub = hw.subset(ids)
    return replace(sub, devices=tuple(replace(d, index=k) for k, d in enumerate(sub.devices)))


def _to_local(plan: Plan, back: dict[int, int]) -> Plan:
    return remap(plan, back)


def _hier(graph: OpGraph, groups: list[_Group], choice: _Choice, fragments: list[list[str]], *, outer_lr: float,
          outer_momentum: float, overlap: bool) -> HierPlan:
    # one codec per sending group (its delta is encoded once, every receiver averages the same values):
    # the one of the fewest bytes that any pair of the group needs
    def rank(c: str) -> float:
        return -codec_ratio(c)

    per_group: dict[int, str] = {}
    for (a, b), c in choice.codecs.items():
        for g in (a, b):
            if g not in per_group or rank(c) > rank(per_group[g]):
                per_group[g] = c
    counts = Counter(per_group.values())
    main = max(counts, key=lambda c: (counts[c], rank(c))) if counts else PREFERRED_CODEC
    link_codecs = {f"g{g}": c for g, c in sorted(per_group.items()) if c != main}
    plans = [GroupPlan(i, g.plan, h) for i, (g, h) in enumerate(zip(groups, choice.hs, strict=True))]
    return HierPlan(plans, fragments, main, link_codecs, outer_lr, outer_momentum, overlap)


def choose_hier_plan(graph: OpGraph, hw: Hardware, scheduler: str, req: Request, *, work: dict[str, OpWork],
                     say: Callable[[str], None], compress: str = "none", place: Callable[[Plan], Plan] | None = None,
                     inner_steps: int | None = None, fragments: int | None = None, codec: str | None = None,
                     outer_lr: float = 1.0, outer_momentum: float = 0.0, overlap: bool = True, group_batch: int | None = None,
                     several: bool = True, max_inner_steps: int = MAX_INNER_STEPS,
                     keep: list[tuple[HierPlan, dict[str, Any]]] | None = None) -> tuple[HierPlan, CostModel]:
    """The plan with the most predicted goodput (tokens/s times per-token efficiency,
    ``planning.efficiency``) among the candidate groupings (module docstring): the one predicted to
    reach a target loss first. ``req`` is one step of the whole run (its batch: the global batch);
    each group of a grouping of M trains ``group_rows(batch, M)`` rows an inner step, or
    ``group_batch`` where given (a grouping whose groups cannot be planned again at it, the planning
    budget spent, is left out). ``several`` (``--sync hierarchical``): only groupings of two groups
    or more, unless none holds the model; without it (``--sync auto``) one synchronous group too.
    Returns the plan with the whole cluster's cost model (no compression). ``place`` takes a plan on
    global worker ids (``choose_plan``'s rule). ``max_inner_steps``: no H above it (the run's steps:
    a longer round would never sync). ``keep``: every candidate's plan and figures are appended to it
    (the run measures the best few: ``control/finalists.py``)."""
    started = time.perf_counter()
    if inner_steps is not None and inner_steps < 1:
        raise ConfigError(f"--inner-steps must be >= 1, got {inner_steps}")
    if fragments is not None and fragments < 1:
        raise ConfigError(f"--fragments must be >= 1, got {fragments}")
    if codec is not None:
        spec = parse_codec(codec)
        if spec.adaptive:
            raise ConfigError(f"--outer-codec {codec!r}: choose a fixed codec (none, fp16, q8 .. q2, topk:RATIO), or leave it out and the planner chooses per pair of groups")
        codec = str(spec)
    cost = CostModel(graph, work, hw)
    n_params = sum(1 for p in graph.params.values() if p.trainable)
    frags = param_fragments(graph, fragments if fragments is not None else min(4, max(1, n_params)))
    planner = _Planner(graph, hw, scheduler, req, work, compress, place)
    everyone = list(range(len(hw)))
    fences = sorted(find_fences(hw), key=lambda f: -sum(device_speed(hw.devices[i]) for i in f))

    groupings: list[tuple[str, list[_Group]]] = []
    whole = planner.plan(everyone)
    if whole is not None:
        groupings.append(("synchronous", [whole]))
    if len(fences) > 1 or len(fences[0]) > 1:
        by_fence = [g for f in fences if (g := planner.plan(f)) is not None]
        if by_fence and len(fences) > 1:
            groupings.append(("fences", by_fence[:MAX_GROUPS]))
        groupings.append(("fences, idle devices regrouped", _regroup(planner, fences)))
        groupings.append(("single devices", _singles(planner, fences)))
        merged = _merge(planner, hw, fences)
        if merged is not None:
            groupings.append(("merged fences, idle devices regrouped", _regroup(planner, merged)))
    groupings = [(name, gs) for name, gs in groupings if gs]
    if not groupings:
        raise ConfigError("no group of devices can hold the model: use devices with more memory or a smaller model")

    several = several and any(len(gs) > 1 for _, gs in groupings)  # (else one group is all there is)
    planners = {req.batch_size: planner}
    best: tuple[HierPlan, RoundResult, str, float, Request, list[_Group]] | None = None
    considered: list[dict[str, Any]] = []
    seen: set[tuple[tuple[int, ...], ...]] = set()
    for name, planned in groupings:
        key = tuple(tuple(g.workers) for g in planned)
        if key in seen:
            continue
        seen.add(key)
        rows = req.batch_size if len(planned) == 1 else (group_batch or group_rows(req.batch_size, len(planned)))
        greq = replace(req, batch_size=rows, micro_batches=micro_batches_for(rows, req.micro_batches))
        groups = planned
        if rows != req.batch_size:  # the same devices, planned again for the group's own batch
            at = planners.setdefault(rows, _Planner(graph, hw, scheduler, greq, work, compress, place))
            again = [at.plan(g.workers) for g in planned]
            if any(g is None for g in again):
                continue
            groups = [g for g in again if g is not None]
        factor = len(groups) * rows / req.batch_size
        hier, result, hidden, eff = _evaluate(graph, cost, greq, groups, frags, inner_steps=inner_steps, codec=codec, outer_lr=outer_lr,
                                              outer_momentum=outer_momentum, overlap=overlap, batch_factor=factor, max_h=max_inner_steps,
                                              fewer_fragments=fragments is None)
        eff *= min(float(g.plan.meta.get("efficiency", 1.0)) for g in groups)  # a data-parallel group's lossy reduce (planning/data_parallel.py)
        goodput = result.tokens_per_s * eff
        considered.append({"grouping": name, "groups": len(groups), "devices_used": len(hier.workers), "group_batch": rows,
                           "tokens_per_s": result.tokens_per_s, "efficiency": eff, "goodput": goodput,
                           "utilization": result.utilization, "round_s": result.round_s,
                           "inner_steps": result.inner_steps, "codec": hier.codec, "traffic_hidden": hidden,
                           "workers": [list(g.workers) for g in groups]})
        if keep is not None:
            hier.group_batch = rows if len(groups) > 1 else None
            keep.append((hier, considered[-1]))
        if several and len(groups) == 1:
            continue  # predicted for the record (meta["synchronous"]), not a choice
        better = best is None or goodput > best[3] * (1 + TIE) or (goodput >= best[3] * (1 - TIE) and len(groups) < len(best[0].groups))
        if better:
            best = (hier, result, name, goodput, greq, groups)
    if best is None:
        raise ConfigError("no grouping of the devices can hold the model at its group batch: pass --group-batch")
    hier, result, name, goodput, req, chosen = best
    hier.group_batch = req.batch_size if len(hier.groups) > 1 else None
    for c in considered:  # time to a target loss against the best candidate's (1: the chosen one)
        c["time_to_target"] = goodput / c["goodput"] if c["goodput"] > 0 else float("inf")
    if overlap:  # the shortest delay from a fragment's send to its apply that the network keeps up with
        for tau in (2, 4, 8, 16, 32, 64):
            if tau >= min(g.inner_steps for g in hier.groups):
                break
            trial = replace(hier, delay_steps=tau, meta={})
            delayed = simulate_rounds(trial, cost, req, steps=[g.step for g in chosen])
            if max(delayed.waits_s, default=0.0) <= 0.02 * delayed.round_s:
                hier.delay_steps, result = tau, delayed
                break
    sync = next((c for c in considered if c["grouping"] == "synchronous"), None)
    hier.meta.update({
        "grouping": name, "delay_steps": hier.delay_steps, "round_s": result.round_s, "tokens_per_s": result.tokens_per_s, "utilization": result.utilization,
        "efficiency": next(c["efficiency"] for c in considered if c["grouping"] == name), "goodput": goodput, "group_batch": req.batch_size,
        "device_utilization": {str(k): v for k, v in result.device_busy.items()},
        "bytes_per_round": result.bytes_per_round, "step_s": result.step_s, "waits_s": result.waits_s,
        "link_busy": result.link_busy, "traffic_hidden": next(c["traffic_hidden"] for c in considered if c["grouping"] == name),
        "unused_devices": sorted(set(everyone) - set(hier.workers)), "candidates": considered,
        "synchronous": {"tokens_per_s": sync["tokens_per_s"], "utilization": sync["utilization"], "goodput": sync["goodput"]} if sync else None,
        "plannings": planner.plannings, "planning_s": time.perf_counter() - started,
    })
    if not hier.meta["traffic_hidden"]:
        say(f"hierarchical: even {max(hier.groups, key=lambda g: g.inner_steps).inner_steps} inner steps with {hier.codec} do not hide "
            f"the traffic between groups (busiest link {result.link_busy:.0%} of the round); groups will wait for it")
    say(f"hierarchical ({name}): {len(hier.groups)} groups on {len(hier.workers)} of {len(hw)} devices, "
        f"H {'/'.join(str(g.inner_steps) for g in hier.groups)}, {len(hier.fragments)} fragments, codec {hier.codec}"
        f", applied {hier.delay_steps or 'a round of'} steps after sending"
        f"{' (+' + str(len(hier.link_codecs)) + ' groups otherwise)' if hier.link_codecs else ''}, predicted {result.round_s:.2f} s/round, "
        f"{result.tokens_per_s:.0f} tokens/s at {hier.meta['efficiency']:.2f} per-token efficiency, utilization {result.utilization:.0%}"
        + (f" (synchronous {sync['tokens_per_s']:.0f} tokens/s, {sync['utilization']:.0%}: {sync['time_to_target']:.2f}x the time to a target)"
           if sync and name != "synchronous" else "")
        + f" [{time.perf_counter() - started:.1f} s to plan]")
    return hier, cost


def _evaluate(graph: OpGraph, cost: CostModel, req: Request, groups: list[_Group], frags: list[list[str]], *,
              inner_steps: int | None, codec: str | None, outer_lr: float, outer_momentum: float,
              overlap: bool, batch_factor: float = 1.0, max_h: int = MAX_INNER_STEPS,
              fewer_fragments: bool = False) -> tuple[HierPlan, RoundResult, bool, float]:
    """A grouping's plan at the H with the most goodput (``--inner-steps``: that H), its simulated
    rounds, whether the traffic hides behind them, and its per-token efficiency (its codec's too).
    ``fewer_fragments`` (no ``--fragments``): at each H one fragment is tried too, and never more
    than H (each fragment's sync pays its fixed costs; a sparse codec's traffic needs no spreading)."""
    traffics: dict[int, tuple[list[list[str]], Traffic]] = {}

    def fragments(count: int) -> tuple[list[list[str]], Traffic]:
        if count not in traffics:
            f = frags if count == len(frags) else param_fragments(graph, count)
            provisional = HierPlan([GroupPlan(i, g.plan, 1) for i, g in enumerate(groups)], f, codec or PREFERRED_CODEC)
            traffics[count] = (f, round_traffic(graph, provisional))
        return traffics[count]

    steps = [g.step for g in groups]
    params = sum(p.meta.numel for p in graph.params.values() if p.trainable)
    tried: list[dict[str, Any]] = []  # per H: the codec chosen and what it gives (the plan's meta["outer_codec_choice"])
    def at(base: int, count: int) -> tuple[HierPlan, RoundResult, bool, float]:
        # the codec of the best measured efficiency that the traffic fits behind (else the fewest bytes, and the groups wait)
        f, traffic = fragments(count)
        candidates = None if codec else outer_codec_candidates(codec_ratio, base)
        choice = choose_inner_steps([s.step_s for s in steps], traffic, cost, inner_steps=base, codec=codec, candidates=candidates)
        hier = _hier(graph, groups, choice, f, outer_lr=outer_lr, outer_momentum=outer_momentum, overlap=overlap)
        result = simulate_rounds(hier, cost, req, steps=steps, traffic=traffic)
        if len(groups) == 1:
            result = alone_rounds(result, steps[0], cost, req)
        per_group = [h / max(t, 1e-12) for h, t in zip(result.inner_steps, result.step_s, strict=True)]  # steps per second of each group
        mean_h = mean_inner_steps(result.inner_steps, per_group)
        codec_eff = 1.0 if len(groups) == 1 else min(codec_efficiency(c, base) for c in {hier.codec, *hier.link_codecs.values()})
        eff = codec_eff * group_efficiency(len(groups), mean_h, batch_factor=batch_factor, params=params)
        return hier, result, choice.hidden, eff

    best: tuple[HierPlan, RoundResult, bool, float] | None = None
    worse = 0
    slow = max(s.step_s for s in steps)
    bases = [h for h in GOODPUT_H if h == 1 or max(round(h * slow / s.step_s) for s in steps) <= max_h] or [1]  # faster groups do more
    for base in [inner_steps] if inner_steps is not None or len(groups) == 1 else bases:
        base = base or MIN_INNER_STEPS
        counts = sorted({1, min(len(frags), base)}) if fewer_fragments else [len(frags)]
        found = max((at(base, c) for c in counts), key=lambda x: x[1].tokens_per_s * x[3])
        hier, result, hidden, eff = found
        tried.append({"inner_steps": max(result.inner_steps), "fragments": len(hier.fragments), "codec": hier.codec,
                      "efficiency": eff, "tokens_per_s": result.tokens_per_s, "goodput": result.tokens_per_s * eff,
                      "traffic_hidden": hidden})
        hier.meta["outer_codec_choice"] = tried
        if best is None or result.tokens_per_s * eff > best[1].tokens_per_s * best[3] * (1 + 1e-9):
            best, worse = found, 0
        else:
            worse += 1
            if worse == 2:  # goodput rises with H while the link holds the groups back, then falls: past its peak
                break
    assert best is not None
    return best


def _regroup(planner: _Planner, sets: list[list[int]]) -> list[_Group]:
    out: list[_Group] = []
    for ids in sets:
        if len(out) >= MAX_GROUPS:
            break
        out += planner.peel(ids, MAX_GROUPS - len(out))
    return out


def _singles(planner: _Planner, fences: list[list[int]]) -> list[_Group]:
    """Every device that holds the model alone is a group; in each fence, the devices that do not
    are grouped as ``_Planner.peel`` does."""
    out: list[_Group] = []
    for fence in fences:
        rest = []
        for d in planner.order(fence):
            g = planner.plan([d]) if len(out) < MAX_GROUPS else None
            if g is not None and g.workers == [d]:
                out.append(g)
            else:
                rest.append(d)
        if rest and len(out) < MAX_GROUPS:
            out += planner.peel(rest, MAX_GROUPS - len(out))
    return out


def _merge(planner: _Planner, hw: Hardware, fences: list[list[int]]) -> list[list[int]] | None:
    """Fences merged greedily while a merge keeps the tokens/s of the two apart (fastest links first,
    ``MAX_MERGE_TRIES`` tries); None when no merge pays."""
    sets = [list(f) for f in fences]
    rate = {tuple(f): (g.tokens_per_step_s if (g := planner.plan(f)) else 0.0) for f in sets}
    tried: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    merged = False
    for _ in range(MAX_MERGE_TRIES):
        pairs = [(fence_link(hw, a, b), i, j) for (i, a), (j, b) in itertools.combinations(enumerate(sets), 2)
                 if (tuple(a), tuple(b)) not in tried]
        if not pairs:
            break
        _, i, j = max(pairs)
        a, b = sets[i], sets[j]
        tried.add((tuple(a), tuple(b)))
        union = sorted(a + b)
        g = planner.plan(union)
        together = g.tokens_per_step_s if g else 0.0
        if together > 0 and together >= rate[tuple(a)] + rate[tuple(b)]:
            rate[tuple(union)] = together
            sets = [s for k, s in enumerate(sets) if k not in (i, j)] + [union]
            merged = True
    return sets if merged else None
