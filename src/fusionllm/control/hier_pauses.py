"""Hierarchical mode's pauses: between two rounds every group stops, so a checkpoint can be written
and workers that joined mid-run can form a new group, from one consistent outer state.

A pause at round ``p``:

1. Every group, at the end of round ``p - 1``, applies every average it has not applied yet (a
   blocking sync of what the overlap would have applied later), then waits. Now every group holds
   the same outer weights and momentum: those after round ``p - 1``.
2. The coordinator does the pause's work: a checkpoint (the outer weights and momentum, one shard
   per stage of one group, ``SaveShard`` with ``outer``), and the join of the spares that
   registered since the last pause (below).
3. The groups go on.

Checkpoints pause at the end of the first round whose steps (counted in the slowest group) reach a
multiple of ``--checkpoint-every``, and the run ends with one. ``--resume`` starts every group
from the newest one, at the round after it: the outer weights and momentum as they were; the inner
AdamW state starts empty (each group had its own).

**Joining.** A worker that registers while a hierarchical run is under way is a spare
(``membership.py``). Every ``POLL_S`` the coordinator looks for spares; it schedules a pause at
the round after the latest one any group has started (or joins at an earlier pause already
scheduled), and there the spares form one new group: a pipeline over them, stages balanced by
parameters (``make_plan``). The coordinator reads the outer weights and momentum from one group's
workers (``GetState`` with ``outer``), assigns the new group's workers with them (their local
weights start as the outer ones; AdamW starts empty), and sends every other worker the new
HierPlan (``Regroup``: who sends which parameter to whom, and the new workers' addresses). The new
group reads batches no other group reads, runs as many inner steps per round as the slowest group
(its speed is not known yet), at the learning rate of the schedule's position; its deltas are
averaged, weighted by tokens, from its first round on. Groups that died are dropped from the new
plan. Spares that come when no round is left stay idle.

A pause costs one blocking sync; a join also the copy of the outer state through the coordinator
(as a re-plan copies the weights).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import replace
from typing import Any

from fusionllm.compress.codecs import parse_codec
from fusionllm.core.errors import FusionError
from fusionllm.schedule.hierarchy import GroupPlan, remap
from fusionllm.schedule.plan import make_plan
from fusionllm.transport.control import WORKER_SERVICE, Regroup
from fusionllm.transport.rpc import RpcClient

from .config import WorkerLost
from .context import RunContext
from .hier_setup import GroupingRun, GroupSetup
from .rounds import wait_notified
from .state import Checkpoints
from .workers import Liveness

POLL_S = 0.5  # how often the coordinator looks for workers that joined


class Pauses:
    """The pauses of a hierarchical run: checkpoints of the outer state, and spares that join."""

    def __init__(self, ctx: RunContext, group_setup: GroupSetup, checkpoints: Checkpoints, live: Liveness, groups: Any) -> None:
        """``groups``: the ``Groups`` whose rounds pause here (their outer syncs, and loops for a new group)."""
        self.ctx, self.group_setup, self.checkpoints, self.live, self.groups = ctx, group_setup, checkpoints, live, groups
        self.membership, self.say = ctx.membership, ctx.say

    async def pauser(self, hr: GroupingRun) -> None:
        """Schedules pauses for spares, and does each pause's work once every group waits at it."""
        ignored: set[int] = set()
        while not hr.stopping:
            async with hr.changed:
                await wait_notified(hr.changed, POLL_S)
            spares = sorted(self.membership.spares - ignored)
            if spares and not self.schedule_join(hr, spares):
                self.say(f"worker(s) {spares} joined, but no outer round is left to join: they stay idle")
                ignored |= set(spares)
            upcoming = [p for p in hr.pausing.pauses if p > hr.pausing.resumed]
            if not upcoming or not hr.alive or not hr.alive <= hr.pausing.arrived or hr.leaving:  # (a group's workers about to be spares)
                continue
            p = min(upcoming)
            try:
                if p in hr.pausing.ckpt_rounds:
                    await self.checkpoint(hr, p)
                if hr.pausing.join_at == p:
                    joining = sorted(self.membership.spares - ignored)
                    try:
                        await self.join(hr, joining, p)
                    except FusionError as exc:
                        self.say(f"worker(s) {joining} could not join as a group: {exc}; they stay idle")
                        self.ctx.metrics.write({"event": "join_failed", "workers": joining, "why": str(exc), "elapsed_s": round(self.ctx.run_seconds(hr.elapsed()), 4)})
                        ignored |= set(joining)
            finally:
                async with hr.changed:
                    hr.pausing.join_at = None if hr.pausing.join_at == p else hr.pausing.join_at
                    hr.pausing.resumed = p
                    hr.pausing.arrived.clear()
                    hr.changed.notify_all()

    def schedule_join(self, hr: GroupingRun, workers: list[int]) -> bool:
        """Schedule the pause at which ``workers`` form a new group: the round after the latest one any
        group has started, or a later pause already scheduled. No await: the groups cannot pass that
        round meanwhile. False when no outer round is left to join (a re-plan, ``end_at``, or a join
        already scheduled takes them in: True)."""
        pausing, clock = hr.pausing, hr.clock
        if not hr.alive or pausing.join_at is not None or clock.end_at is not None:
            return True
        k0 = max(clock.current.get(g, clock.first_round.get(g, 0)) for g in hr.alive) + 1
        if k0 >= clock.rounds:
            return False
        later = [p for p in pausing.pauses if p > pausing.resumed and p >= k0]
        pausing.join_at = min(later) if later else k0
        pausing.pauses.add(pausing.join_at)
        self.say(f"worker(s) {workers} form a new group at outer round {pausing.join_at}")
        return True

    async def pause(self, hr: GroupingRun, g: int, p: int, pending: list[tuple[int, int, int]]) -> None:
        """Group ``g`` at the end of round ``p - 1``: apply what it has not applied, then wait for
        the pause's work to be done."""
        paused = time.perf_counter()
        for _, f, r in sorted(pending, key=lambda x: (x[2], x[1])):
            await self.groups.outer.sync(hr, g, f, r, 0, [r], send=False)
        pending.clear()
        async with hr.changed:
            hr.pausing.arrived.add(g)
            hr.changed.notify_all()
            while hr.pausing.resumed < p and g in hr.alive:
                await hr.changed.wait()
        if g not in hr.alive:  # it left during the pause (a worker of it was lost in the checkpoint)
            raise FusionError(f"group {g} left the run during the pause at outer round {p}")
        self.ctx.metrics.write({"event": "paused", "group": g, "round": p, "seconds": round(time.perf_counter() - paused, 4),
                       "elapsed_s": round(self.ctx.run_seconds(hr.elapsed()), 4)})

    async def checkpoint(self, hr: GroupingRun, p: int) -> None:
        """The outer weights and momentum after round ``p - 1`` (the same in every group), from one group.

        Its workers' heartbeats are watched meanwhile (``_guard``): a worker lost there, dead or hung,
        takes its group out of the run, and the next group's copy is written instead of the run
        waiting for the hung one until the step timeout."""
        while hr.alive:
            step = hr.step_at(p)
            g = min(hr.alive)
            run = hr.runs[g]
            try:
                await self.live.guard(run, self.checkpoints.checkpoint(run, step, outer=True, extra={"sync": "hierarchical", "round": p},
                                                                       plan_json=hr.hier.to_json()))
                return
            except WorkerLost as exc:
                await self.groups.left(hr, g, exc, gone=set(exc.workers))
        raise FusionError(f"no group is left to write the checkpoint of outer round {p} from")

    async def join(self, hr: GroupingRun, workers: list[int], k0: int) -> None:
        """The spares ``workers`` form a new group that takes part from round ``k0``."""
        if not workers:
            return
        began = time.perf_counter()
        index, source = await self.add_group(hr, workers, k0)
        hr.loops[index] = self.groups.start(hr, index)
        members = self.membership.members
        event = {"event": "group_joined", "group": index, "workers": workers, "round": k0, "source_group": source,
                 "addresses": {str(w): members[w].address for w in workers if w in members},
                 "seconds": round(time.perf_counter() - began, 3), "elapsed_s": round(self.ctx.run_seconds(hr.elapsed()), 4)}
        self.ctx.event(event)
        self.say(f"group {index} (workers {workers}) joined at outer round {k0} in {event['seconds']:.1f} s, "
                 f"with group {source}'s outer weights and momentum")

    async def add_group(self, hr: GroupingRun, workers: list[int], k0: int) -> tuple[int, int]:
        """Plan, assign and announce the new group; returns its index and the group its state came from."""
        c = self.ctx.cluster
        members = self.membership.members
        source = min(hr.alive)
        src = hr.runs[source]
        states = [await self.checkpoints.read_state(src, s.workers[0], outer=True) for s in src.plan.stages]
        micro = math.gcd(self.group_setup.group_batch(), c.micro_batches)  # as setup_groups traced hr.graph
        plan = remap(make_plan(hr.graph, len(workers), schedule=c.schedule, micro_batches=micro), workers)
        clients = src.clients  # one dict, shared by every group's Run
        run = await self.group_setup.setup.placed_run(hr.graph, plan, clients)  # as any group's plan is
        plan = run.plan
        addresses = {m.id: m.address for m in members.values()}
        for w in workers:
            clients[w] = RpcClient(addresses[w], WORKER_SERVICE, c.token, tls=c.tls, incarnation=self.membership.incarnation)
        live = [g for g in hr.hier.groups if g.index in hr.alive]
        ref = min(live, key=lambda g: g.inner_steps)  # the slowest group's H: the new group's speed is not known yet
        index = max(g.index for g in hr.hier.groups) + 1
        hier = replace(hr.hier, groups=[*live, GroupPlan(index, plan, ref.inner_steps)])
        text = hier.to_json()
        run.hier = text
        await self.group_setup.setup.assign(run, addresses, states, None, parse_codec(c.compress), rows=self.group_setup.group_batch())
        if run.fed and self.group_setup.group_batch() != self.ctx.train.batch_size:
            raise FusionError("--group-batch needs workers that read their own data")
        new = {str(w): addresses[w] for w in workers}
        data = {str(w): members[w].info.data_address for w in workers if members[w].info.data_address}
        old = [w for g in live for w in g.workers]
        await asyncio.gather(*(clients[w].call_retrying("Regroup", Regroup(text, new, data).to_wire(), within=c.step_timeout, timeout=c.step_timeout)
                               for w in old))
        for r in hr.runs.values():
            r.hier = text
        hr.hier = hier
        hr.runs[index] = run
        hr.clock.join(index, ref.index, k0)
        hr.data.join(index, max(sum(x) for x in hr.clock.lengths.values()))  # past every batch another group reads
        hr.alive.add(index)
        self.membership.spares -= set(workers)
        return index, source
