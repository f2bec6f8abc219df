"""Setting up any grouping: one group by ``Setup.setup``, several by forming the groups (trace,
plan each group, assign, lay out the rounds); ``setup_grouping`` is the one entry point.

The groups come from the planner (``--scheduler``: ``planning`` forms them, with H and the codec)
or from ``--groups`` by hand. Each group's plan is placed, validated and sized like a synchronous
plan (``setup.py``), and every worker gets the ``HierPlan`` with its assignment. ``GroupingRun`` is
the run's state while the groups train (``hierarchical.py``) and pause (``hier_pauses.py``).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

from fusionllm.compress.codecs import parse_codec
from fusionllm.core.config import TrainResult
from fusionllm.core.errors import ConfigError, FusionError
from fusionllm.graph.ir import OpGraph
from fusionllm.schedule.hierarchy import HierPlan, group_rows, make_hier_plan, round_lengths
from fusionllm.schedule.plan import Request
from fusionllm.transport.control import WORKER_SERVICE, LiveState
from fusionllm.transport.rpc import RpcClient

from .capabilities import backend_of, place
from .config import Run
from .context import RunContext
from .outer_eval import OuterEvals
from .restart import resume_event, resume_live, start_or_resume
from .rounds import (
    DataOffsets,
    PauseSchedule,
    RoundClock,
    budget_rounds,
    checkpoint_rounds,
    resume_round,
)
from .setup import Setup
from .state import Checkpoints
from .status import stage_rows


@dataclass
class GroupingRun:
    """A grouping while it trains (``hierarchical.py``) and, of several groups, pauses
    (``hier_pauses.py``): the groups' plans and runs, which are alive, and the components that own
    the rest: where each group is (``clock``), which batches they read (``data``), and when they
    pause (``pausing``). The outer syncs' own state is ``outer_rounds.OuterRounds``'s. One group
    (``hier`` None, ``one_group``) is the same with rounds of one step and no pause."""

    hier: HierPlan | None  # None: one group (synchronous), whose rounds are one step each
    graph: OpGraph
    runs: dict[int, Run]  # group -> its synchronous run
    alive: set[int]
    clock: RoundClock
    data: DataOffsets
    pausing: PauseSchedule
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)  # a group sent, left, arrived at a pause
    round_s: dict[int, float] = field(default_factory=dict)  # the last round's wall time per group
    result: TrainResult = field(default_factory=TrainResult)
    started: float = 0.0
    paused: float = 0.0  # seconds one group spent evaluating (left out of its clock; several groups never pause it: outer_eval.py)
    leaving: int = 0  # groups whose workers not to blame are being told to abort (spares once they answer): pauses wait
    loops: dict[int, asyncio.Task] = field(default_factory=dict)
    stopping: bool = False  # the run is over: the pauser ends
    evals: OuterEvals = field(default_factory=OuterEvals)  # evaluations whose groups' shares are not all in (outer_eval.py)

    def step_at(self, p: int) -> int:
        """The user's step once rounds ``0 .. p - 1`` are done (``RoundClock.step_at``, the live groups)."""
        return self.clock.step_at(p, self.alive)

    def expected(self, r: int) -> set[int]:
        """The live groups that take part in round ``r``."""
        return self.clock.expected(r, self.alive)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started - self.paused


def one_group(run: Run, first: int, last: int, data_offset: int) -> GroupingRun:
    """A grouping of one group over steps ``first`` to ``last``: a round of it is one step (no outer
    sync, no pause), and step ``s`` reads batch ``s + data_offset``."""
    n = max(0, last - first)
    return GroupingRun(None, run.graph, {0: run}, alive={0}, clock=RoundClock(first, last, {0: [1] * n}),
                   data=DataOffsets(first + data_offset, 1, next=first + data_offset), pausing=PauseSchedule(set(), set()))


class GroupSetup:
    """Forms the groups (by the planner, or ``--groups``), plans each, and assigns every worker."""

    def __init__(self, ctx: RunContext, setup: Setup, checkpoints: Checkpoints) -> None:
        self.ctx, self.setup, self.checkpoints = ctx, setup, checkpoints
        self.train, self.cluster, self.task, self.membership, self.say = ctx.train, ctx.cluster, ctx.task, ctx.membership, ctx.say
        self.resumed: tuple[list[bytes], int, OpGraph] | str | None = None  # --resume: what resume_live found (restart.py)
        self.resume_record: dict[str, Any] | None = None  # the ``resume`` record of the run's start, once set up
        self.rows: int | None = None  # the groups' rows per inner step, once planned

    async def setup_grouping(self, *, groups: list[list[int]] | None, first: int, last: int, states: list[Any] | None, data_from: int,
                             hier: HierPlan | None, began: float, alone: int | None = None) -> tuple[GroupingRun, Run | None]:
        """Any grouping set up: one group (``groups`` None) by ``Setup.setup`` (the run's start, with
        ``--resume``, by ``start_or_resume``), several by ``setup_groups``; and, for one group, its
        plan in force. ``states``: the live weights it starts from (None: the run's start); ``began``:
        when the coordinator started (the ``resume`` record's seconds); ``alone``: one group of this
        device alone (a finalist, ``control/finalists.py``)."""
        if groups is not None:
            hr = await self.setup_groups(groups=groups or None, first=first, last=last, states=states, data_from=data_from, hier=hier)
            if self.resumed is not None:
                self.resume_record = resume_event(self.ctx, self.resumed, began)
            return hr, None
        if states is None:  # the run's start: from scratch, a checkpoint or the workers' live state
            run, self.resume_record = await start_or_resume(self.ctx, self.setup, self.checkpoints, began)
        else:
            run = await self.setup.setup(carry=(states, first), alone=alone)
        return one_group(run, self.ctx.clock.start_step, last, data_from - first), run

    def group_batch(self) -> int:
        """Rows per inner step of every group: the plan's once planned (``--group-batch``, else the
        run's global batch ``--batch-size`` shared by the groups), before it ``--group-batch`` or
        ``--batch-size`` (the batch the model is traced at)."""
        return self.rows or self.cluster.group_batch or self.train.batch_size

    async def traced_as(self, digest: str, graph: OpGraph, groups: list[list[int]] | None) -> OpGraph | None:
        """The model traced as the workers' groups ran it (``digest``: their graph's), or None: at the
        rows per micro-batch of the groups' batch, for every number of groups the run could have had
        (the planner's groups share --batch-size as ``group_rows`` does)."""
        t, c = self.train, self.cluster
        counts = [len(groups)] if groups else range(1, len(self.membership.members) + 1)
        rows = [c.group_batch] if c.group_batch else [group_rows(t.batch_size, n) for n in counts]
        traced = graph.input_nodes[0].outputs[0].meta.shape[0] if graph.input_nodes else None
        for r in dict.fromkeys([traced, *(r // math.gcd(r, c.micro_batches) for r in rows)]):
            again = graph if r == traced else await asyncio.to_thread(self.task.trace, r)
            if r is not None and LiveState.graph_digest(again.to_json()) == digest:
                return again
        return None

    async def setup_groups(self, *, groups: list[list[int]] | None = None, first: int = 0, last: int | None = None,
                           states: list[Any] | None = None, data_from: int = 0, hier: HierPlan | None = None) -> GroupingRun:
        """Every group's plan assigned; the rounds laid out (and resumed from a checkpoint's).

        A regroup passes the grouping (``groups``; default ``--groups`` or the planner's), the steps
        it trains (``first`` to ``last``), the live weights it starts from (``states``: a
        synchronous plan's weights and AdamW state, or a grouping's outer weights and momentum), and
        the first batch no earlier grouping read (``data_from``); ``hier``: the planner's groups, when
        it chose them (``grouping.choose``)."""
        t, c = self.train, self.cluster
        last = t.steps if last is None else last
        groups = c.groups if groups is None else groups
        batch = self.group_batch()
        if batch % c.micro_batches:
            raise ConfigError(f"--group-batch {batch} must be a multiple of --micro-batches {c.micro_batches}")
        if c.eval_every and (t.batch_size % batch):
            raise ConfigError(f"--group-batch {batch} must divide --batch-size {t.batch_size} (the validation batches are cut from it)")
        graph = await asyncio.to_thread(self.task.trace, batch // c.micro_batches)
        self.ctx.clock.start_at(first)
        resumed = c.resume and states is None
        if resumed:  # --resume: one group's outer weights and momentum as the workers hold them, else the newest checkpoint's
            self.resumed = await resume_live(self.ctx, self.checkpoints, lambda digest: self.traced_as(digest, graph, groups), outer=True)
            if not isinstance(self.resumed, str):
                states, step, _ = self.resumed
                self.resumed = ([], step, graph)  # (the states are not kept past the assignment)
                self.say(f"resuming from the workers' live state: one group's outer weights and momentum at step {step}")
        found = self.checkpoints.resume(graph) if resumed and states is None else None  # the outer weights and momentum of a hierarchical checkpoint
        load = found[0] if found else None
        if found:
            self.ctx.clock.start_at(found[1])
        if states is None:
            states = [] if load else [await asyncio.to_thread(self.task.initial_state)]
        addresses = {m.id: m.address for m in self.membership.members.values()}
        clients = {w: RpcClient(a, WORKER_SERVICE, c.token, tls=c.tls, incarnation=self.membership.incarnation) for w, a in addresses.items()}
        infos = {w: m.info for w, m in self.membership.members.items()}
        if hier is None and c.scheduler and not groups:
            hier = await self.schedule(graph, clients, last - first)
        elif hier is None:
            unknown = sorted({w for g in groups or [] for w in g} - set(addresses))
            if unknown:
                raise ConfigError(f"--groups names worker(s) {unknown}, but the workers are {sorted(addresses)}")
            rows = c.group_batch or group_rows(t.batch_size, len(groups or []))  # the global batch kept
            hier = make_hier_plan(graph, groups or [], inner_steps=c.inner_steps or 4, fragments=c.fragments or 1, schedule=c.schedule,
                                  micro_batches=math.gcd(rows, c.micro_batches), codec=c.outer_codec or "q4", outer_lr=c.outer_lr,
                                  outer_momentum=c.outer_momentum, overlap=not c.blocking_sync,
                                  delay_steps=c.overlap_steps or 0)
            hier.group_batch = rows
        traced = batch // c.micro_batches
        batch = self.rows = hier.group_batch or batch
        if c.eval_every and (t.batch_size % batch):
            raise ConfigError(f"--group-batch {batch} must divide --batch-size {t.batch_size} (the validation batches are cut from it)")
        runs: dict[int, Run] = {}
        graphs = {traced: graph}  # a group whose micro-batches have other rows runs the model traced at their size

        async def traced_at(rows: int) -> OpGraph:
            if rows not in graphs:
                again = await asyncio.to_thread(self.task.trace, rows)
                if [(n.id, n.kind) for n in again.nodes] != [(n.id, n.kind) for n in graph.nodes]:
                    raise FusionError("the model traces differently at another micro-batch size; pass --micro-batches and --groups by hand")
                graphs[rows] = again
            return graphs[rows]

        for g in hier.groups:
            m = g.plan.micro_batches
            if batch % m:
                raise FusionError(f"group {g.index} has {m} micro-batches, which does not divide the group batch {batch}")
            runs[g.index] = await self.setup.placed_run(await traced_at(batch // m), g.plan, clients)  # as one group's plan is
            g.plan = runs[g.index].plan
        graph = await traced_at(batch // math.gcd(batch, c.micro_batches))  # the model at the group batch's default micro-batches (a joining group's)
        text = hier.to_json()
        for run in runs.values():
            run.hier = text
        for line in hier_lines(hier, addresses):
            self.say(line)
        codec = parse_codec(c.compress)
        if codec.adaptive:  # each group's own link policy, as a synchronous plan's
            await self.policies(graph, hier, runs, clients)
        # every group reads batches of its own size; validation: the same windows, in smaller batches
        await asyncio.gather(*(self.setup.assign(run, addresses, states, load, codec, rows=batch) for run in runs.values()))
        if batch != t.batch_size and any(run.fed for run in runs.values()):
            raise FusionError(f"the groups read batches of {batch} rows (--batch-size {t.batch_size} shared by {len(hier.groups)} groups), which "
                              f"needs workers that read their own data (some cannot: see above); pass --group-batch {t.batch_size}")
        rounds = budget_rounds(last - first, [g.inner_steps for g in hier.groups])  # the run's tokens, whatever each group's H
        record = {
            "event": "plan", "sync": "hierarchical", "epoch": self.ctx.clock.epoch, "rounds": rounds, "fragments": len(hier.fragments),
            "codec": hier.codec, "outer_lr": hier.outer_lr, "outer_momentum": hier.outer_momentum, "overlap": hier.overlap,
            "groups": [{"group": g.index, "workers": g.workers, "inner_steps": g.inner_steps, "stages": stage_rows(runs[g.index].graph, g.plan),
                        "schedule": g.plan.schedule, "micro_batches": g.plan.micro_batches,
                        "predicted_step_s": g.plan.meta.get("predicted_step_s")} for g in hier.groups],
            "predicted": {k: v for k, v in hier.meta.items() if k != "candidates"},
            "workers": {str(w): {"address": a, "backend": backend_of(infos[w]), "device": infos[w].device.kind, "in_plan": w in hier.workers}
                        for w, a in addresses.items()},
        }
        self.ctx.status.event(record)
        self.setup.plan_record = record
        base = min(g.inner_steps for g in hier.groups)
        lengths = {g.index: round_lengths(g.inner_steps, base, rounds) for g in hier.groups}
        record["round_lengths"] = {str(k): v for k, v in lengths.items()}
        ref = lengths[min(hier.groups, key=lambda g: g.inner_steps).index]  # steps are counted in the slowest group
        start = resume_round(ref, self.ctx.clock.start_step - first) if resumed else 0
        if resumed and self.ctx.clock.start_step > first:
            self.say(f"resuming the outer weights and momentum at outer round {start} of {len(ref)}")
        ckpt = checkpoint_rounds(ref, c.checkpoint_every)
        clock = RoundClock(first, last, lengths, first_round={g.index: start for g in hier.groups}, current={g.index: start for g in hier.groups})
        return GroupingRun(hier, graph, runs, alive={g.index for g in hier.groups}, clock=clock,
                       data=DataOffsets(data_from, len(hier.groups), next=data_from),
                       pausing=PauseSchedule({p for p in ckpt if p > start}, ckpt, resumed=start))

    async def policies(self, graph: OpGraph, hier: HierPlan, runs: dict[int, Run], clients: dict[int, RpcClient]) -> None:
        """Each group's own AdaTopK link policy, as a synchronous plan's."""
        cost = await self.setup.cost(graph, clients)
        for g in hier.groups:
            runs[g.index].policy = await asyncio.to_thread(self.setup.adatopk, g.plan, cost, self.group_batch(), indent=f"  group {g.index} ")

    async def schedule(self, graph: OpGraph, clients: dict[int, RpcClient], steps: int, keep: list[Any] | None = None) -> HierPlan:
        """The planner's groups for ``steps`` steps (no H beyond them); ``keep``: every candidate's
        plan and figures (``choose_hier_plan``)."""
        from fusionllm.planning.hierarchy import choose_hier_plan

        c = self.cluster
        hw = await self.setup.hardware(clients)
        work = await asyncio.to_thread(self.task.estimate, graph)
        infos = {w: m.info for w, m in self.membership.members.items()}

        def placed(p: Any) -> Any:
            return place(graph, p, infos, lambda _: None, self.task.refused_ops)

        req = Request(self.train.batch_size, self.task.items_per_row, c.micro_batches, c.schedule)  # one step of the run: the global batch
        hier, _ = await asyncio.to_thread(
            choose_hier_plan, graph, hw, c.scheduler, req, work=work, say=self.say, compress=str(parse_codec(c.compress)), place=placed,
            inner_steps=c.inner_steps, fragments=c.fragments, codec=c.outer_codec, outer_lr=c.outer_lr, outer_momentum=c.outer_momentum,
            overlap=not c.blocking_sync, group_batch=c.group_batch, several=c.sync != "auto", max_inner_steps=max(1, steps), keep=keep,
        )
        if c.overlap_steps is not None:
            hier.delay_steps = c.overlap_steps
        return hier


def hier_lines(hier: HierPlan, addresses: dict[int, str]) -> list[str]:
    """What the coordinator says about the groups it starts."""
    lines = [f"hierarchical plan: {len(hier.groups)} groups, {len(hier.fragments)} fragments, pseudo-gradients as {hier.codec}, "
             f"outer Nesterov lr {hier.outer_lr} momentum {hier.outer_momentum}, "
             + (f"averages applied {hier.delay_steps or 'a round of'} inner steps after their send" if hier.overlap else "blocking sync")]
    for g in hier.groups:
        stages = " | ".join(",".join(map(str, s.workers)) for s in g.plan.stages)
        lines.append(f"  group {g.index}: workers [{stages}] ({len(g.plan.stages)} stages), {g.inner_steps} inner steps per round")
    for w in sorted(set(addresses) - set(hier.workers)):
        lines.append(f"  worker {w} ({addresses[w]}): idle (in no group)")
    return lines

