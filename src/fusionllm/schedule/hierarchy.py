"""A hierarchical plan: replica groups that each hold the whole model, synchronised every few steps.

Inside a group training is synchronous (a ``Plan`` over the group's workers: a pipeline, replicas
inside as usual). Across groups it is DiLoCo-like: every ``inner_steps`` steps of its own a group
sends the change of its weights since the last sync (the pseudo-gradient), per fragment of the
parameters, and every holder of a parameter applies the same outer optimiser step to the same
token-weighted average, so all groups keep one set of outer weights.

This module is the plan's data and its pure rules (fragments, when a fragment syncs, who sends what
to whom); the planner that chooses groups is ``planning/hierarchy.py``, the round simulator
``sim/rounds.py``, the exchange itself ``runtime/stage/outer.py``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

from fusionllm.core.errors import ConfigError
from fusionllm.graph.ir import OpGraph
from fusionllm.schedule.plan import Plan, Request, StagePlan, make_plan


@dataclass
class GroupPlan:
    """One replica group: its workers (global ids), its synchronous plan, its inner steps per round."""

    index: int
    plan: Plan  # worker ids are the run's global ids
    inner_steps: int  # H of this group: inner steps per outer round (a faster group does more)

    @property
    def workers(self) -> list[int]:
        return self.plan.workers


@dataclass
class HierPlan:
    groups: list[GroupPlan]
    fragments: list[list[str]]  # parameter names, each fragment synced at its own offset in the round
    codec: str = "q4"  # pseudo-gradients across groups (a codec of compress/codecs/), with error feedback
    link_codecs: dict[str, str] = field(default_factory=dict)  # "gA" -> codec of group A's pseudo-gradients, where not ``codec``
    outer_lr: float = 1.0  # measured better than DiLoCo's 0.7 / 0.9 at the H this planner picks (benchmarks/results/hier_convergence.md)
    outer_momentum: float = 0.0
    overlap: bool = True  # a fragment's average is applied later than it is sent (the inner loop does not wait for it)
    meta: dict = field(default_factory=dict)  # predictions: round_s, utilization, bytes per round, ...
    delay_steps: int = 0  # with overlap: inner steps between a fragment's send and its apply (0: one round, H)
    group_batch: int | None = None  # rows of every group's inner step (None: the run's --group-batch or --batch-size)

    def delay_of(self, group: GroupPlan) -> int:
        """Inner steps from a fragment's send to its apply in ``group`` (0: blocking, right after the send)."""
        if not self.overlap:
            return 0
        return min(self.delay_steps, group.inner_steps) if self.delay_steps > 0 else group.inner_steps

    def __post_init__(self) -> None:
        seen: set[int] = set()
        for g in self.groups:
            if seen & set(g.workers):
                raise ConfigError(f"a worker is in two groups: {sorted(seen & set(g.workers))}")
            seen.update(g.workers)
            if g.inner_steps < 1:
                raise ConfigError(f"group {g.index}: inner steps per round must be >= 1, got {g.inner_steps}")
        if not self.fragments or any(not f for f in self.fragments):
            raise ConfigError("a hierarchical plan needs at least one fragment, none empty")
        if self.delay_steps < 0:
            raise ConfigError(f"the delay between a fragment's send and its apply must be >= 0 steps, got {self.delay_steps}")
        if not 0 < self.outer_lr <= 10 or not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"outer lr {self.outer_lr} (0, 10] and momentum {self.outer_momentum} [0, 1) expected")

    @property
    def workers(self) -> list[int]:
        return sorted(w for g in self.groups for w in g.workers)

    def request(self, req: Request) -> Request:
        """One inner step of one group, for a run whose step is ``req`` (its global batch)."""
        if self.group_batch is None:
            return req
        return replace(req, batch_size=self.group_batch, micro_batches=math.gcd(self.group_batch, req.micro_batches))

    def group_of(self, worker: int) -> GroupPlan:
        for g in self.groups:
            if worker in g.workers:
                return g
        raise ConfigError(f"worker {worker} is in no group")

    def codec_of(self, group: int) -> str:
        """The codec of a group's pseudo-gradients: one per sending group, so every receiver (and the
        group itself) averages the same decoded values."""
        return self.link_codecs.get(f"g{group}", self.codec)

    def codec_between(self, a: int, b: int) -> str:
        """The codec of what group ``a`` sends to group ``b`` (the sender's)."""
        return self.codec_of(a)

    def to_json(self) -> str:
        return json.dumps({
            "groups": [{"index": g.index, "inner_steps": g.inner_steps, "plan": json.loads(g.plan.to_json())} for g in self.groups],
            "fragments": self.fragments, "codec": self.codec, "link_codecs": self.link_codecs,
            "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum, "overlap": self.overlap, "meta": self.meta,
            "delay_steps": self.delay_steps, "group_batch": self.group_batch,
        })

    @staticmethod
    def from_json(text: str) -> HierPlan:
        obj = json.loads(text)
        groups = [GroupPlan(int(g["index"]), Plan.from_json(json.dumps(g["plan"])), int(g["inner_steps"])) for g in obj["groups"]]
        return HierPlan(groups, [[str(p) for p in f] for f in obj["fragments"]], str(obj["codec"]), dict(obj.get("link_codecs", {})),
                        float(obj["outer_lr"]), float(obj["outer_momentum"]), bool(obj["overlap"]), dict(obj.get("meta", {})),
                        int(obj.get("delay_steps", 0)), None if obj.get("group_batch") is None else int(obj["group_batch"]))


def remap(plan: Plan, ids: list[int] | dict[int, int]) -> Plan:
    """A plan made over workers ``0..k-1`` put on the workers ``ids`` (local ``i`` becomes ``ids[i]``;
    a dict: any worker ``w`` becomes ``ids[w]``), its replicas' shares and reduce sites with it."""
    stages = [StagePlan(s.index, list(s.nodes), [ids[w] for w in s.workers], list(s.shares) if s.shares else None) for s in plan.stages]
    reduce = replace(plan.reduce, sites=tuple(tuple(ids[w] for w in site) for site in plan.reduce.sites)) if plan.reduce else None
    return Plan(stages, plan.schedule, plan.micro_batches, dict(plan.meta), reduce)


def make_hier_plan(graph: OpGraph, groups: list[list[int]], *, inner_steps: list[int] | int = 4, fragments: int = 1,
                   schedule: str = "1f1b", micro_batches: int = 4, codec: str = "q4", outer_lr: float = 1.0,
                   outer_momentum: float = 0.0, overlap: bool = True, delay_steps: int = 0) -> HierPlan:
    """A hierarchical plan by hand: each group one stage per worker balanced by parameters
    (``make_plan``), ``inner_steps`` per group (or one value for all)."""
    hs = [inner_steps] * len(groups) if isinstance(inner_steps, int) else list(inner_steps)
    if len(hs) != len(groups):
        raise ConfigError(f"{len(groups)} groups but {len(hs)} inner-step counts")
    plans = [GroupPlan(i, remap(make_plan(graph, len(ws), schedule=schedule, micro_batches=micro_batches), sorted(ws)), h)
             for i, (ws, h) in enumerate(zip(groups, hs, strict=True))]
    return HierPlan(plans, param_fragments(graph, fragments), codec, {}, outer_lr, outer_momentum, overlap, delay_steps=delay_steps)


def param_fragments(graph: OpGraph, count: int) -> list[list[str]]:
    """The trainable parameters in graph order, cut into ``count`` contiguous fragments of about
    equal size (fewer when there are fewer parameters)."""
    names = [n for n, p in graph.params.items() if p.trainable]
    if not names:
        raise ConfigError("the model has no trainable parameter to synchronise")
    count = max(1, min(count, len(names)))
    sizes = [graph.params[n].meta.numel for n in names]
    total = sum(sizes)
    out: list[list[str]] = [[] for _ in range(count)]
    done = 0
    for name, size in zip(names, sizes, strict=True):
        f = min(count - 1, int(count * (done + size / 2) / total))
        out[f].append(name)
        done += size
    return [f for f in out if f]


def group_rows(batch_size: int, groups: int) -> int:
    """Rows of one group's inner step that keep the run's global batch: the largest divisor of
    ``batch_size`` (the validation batches are cut from it) at most ``batch_size / groups``."""
    if groups <= 1:
        return batch_size
    return max(d for d in range(1, batch_size // groups + 1) if batch_size % d == 0) if batch_size >= groups else 1


def micro_batches_for(rows: int, micro_batches: int) -> int:
    """The most micro-batches at most ``micro_batches`` that divide ``rows``."""
    return max(m for m in range(1, min(rows, micro_batches) + 1) if rows % m == 0)


def sync_offsets(inner_steps: int, fragments: int) -> list[int]:
    """After which inner step of a round (1..H) each fragment syncs: staggered evenly over the round
    (Streaming DiLoCo), the last fragment at the round's end."""
    return [max(1, round(inner_steps * (f + 1) / fragments)) for f in range(fragments)]


def round_lengths(inner_steps: int, base: int, rounds: int) -> list[int]:
    """Inner steps of each round of a group whose H is ``inner_steps`` (``base``: the H of the plan's
    slowest group, the same for every group, so every group has the same number of rounds): every
    round ``inner_steps`` (warm-up rounds of 1, 2, 4 .. steps were measured without a clear gain)."""
    return [inner_steps] * rounds


def leader(group: GroupPlan, holders: list[int]) -> int:
    """The one worker of a group that sends a parameter's pseudo-gradient (replicas hold the same)."""
    return min(holders)


def holders(graph: OpGraph, plan: Plan) -> dict[str, list[int]]:
    """Which workers of a group hold each parameter (a tied weight: several stages)."""
    out: dict[str, list[int]] = {}
    for s in plan.stages:
        for n in plan.stage_params(graph, s.index):
            out.setdefault(n, []).extend(s.workers)
    return {n: sorted(ws) for n, ws in out.items()}


@dataclass(frozen=True)
class Exchange:
    """What one worker sends and receives when one fragment syncs (per peer: parameter names, in order)."""

    sends: dict[int, list[str]]  # destination worker -> names this worker sends it
    receives: dict[int, tuple[int, list[str]]]  # source worker -> (its group, names it sends here)
    mine: list[str]  # the fragment's parameters this worker holds
    leads: list[str] = field(default_factory=list)  # of those, the ones it leads in its group: its group's leaders cover the fragment once


def exchange(graph: OpGraph, hier: HierPlan, worker: int, fragment: int) -> Exchange:
    """Every holder of a parameter gets it from one leader of every other group; it computes its
    own group's share itself (replicas have the same weights and the same error-feedback state)."""
    frag = set(hier.fragments[fragment])
    per_group = {g.index: holders(graph, g.plan) for g in hier.groups}
    me = hier.group_of(worker).index
    mine = sorted(n for n, ws in per_group[me].items() if worker in ws and n in frag)
    sends: dict[int, list[str]] = {}
    receives: dict[int, tuple[int, list[str]]] = {}
    for name in mine:
        for g in hier.groups:
            if g.index == me or name not in per_group[g.index]:
                continue
            if leader(hier.group_of(worker), per_group[me][name]) == worker:
                for dst in per_group[g.index][name]:
                    sends.setdefault(dst, []).append(name)
            src = leader(g, per_group[g.index][name])
            receives.setdefault(src, (g.index, []))[1].append(name)
    leads = [n for n in mine if leader(hier.group_of(worker), per_group[me][n]) == worker]
    return Exchange(sends, receives, mine, leads)
