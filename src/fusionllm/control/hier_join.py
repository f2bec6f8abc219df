"""Hierarchical mode: workers that join mid-run form a new group with the current outer state.

A worker that registers while a hierarchical run is under way is a spare (``membership.py``).
Every ``JOIN_POLL_S`` the coordinator looks for spares; those it finds form one new group (a
pipeline over them, stages balanced by parameters, ``make_plan``), which takes part in the outer
rounds from ``k0``, the round after the latest one any group has started:

1. Every group, at the end of round ``k0 - 1``, applies every average it has not applied yet (a
   blocking sync of what the overlap would have applied later), then pauses. Now every group holds
   the same outer weights and momentum: those after round ``k0 - 1``.
2. The coordinator reads the outer weights and momentum from one group's workers (``GetState`` with
   ``outer``), assigns the new group's workers with them (their local weights start as the outer
   ones; their AdamW state starts empty), and sends every other worker the new HierPlan
   (``Regroup``: who sends which parameter to whom, and the new workers' addresses).
3. The groups go on. The new group reads batches no other group reads, runs as many inner steps per
   round as the plan's slowest group, at the learning rate of the schedule's position, and its
   deltas are averaged (weighted by tokens) from round ``k0`` on. Groups that died are dropped from
   the new plan.

A join costs one blocking sync and the time to copy the outer state (through the coordinator, as a
re-plan copies the weights). Spares that come when no round is left stay idle.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

from fusionllm.compress.codecs import parse_codec
from fusionllm.core.errors import FusionError
from fusionllm.core.metrics import JsonlWriter
from fusionllm.schedule.hierarchy import GroupPlan, remap
from fusionllm.schedule.plan import make_plan
from fusionllm.schedule.validate import validate_plan
from fusionllm.transport.control import WORKER_SERVICE, Regroup
from fusionllm.transport.rpc import RpcClient

from .capabilities import place
from .config import Run
from .limits import check_message_sizes

JOIN_POLL_S = 0.5  # how often the coordinator looks for workers that joined


class HierJoinMixin:
    """The coordinator's half of groups joining a hierarchical run (``Coordinator`` mixes it in)."""

    async def _watch_joins(self, hr: Any, metrics: JsonlWriter) -> None:
        ignored: set[int] = set()
        while True:
            await asyncio.sleep(JOIN_POLL_S)
            spares = sorted(self.membership.spares - ignored)
            if not spares or not hr.alive:
                continue
            k0 = max(hr.current[g] for g in hr.alive) + 1
            if k0 >= hr.rounds:
                self.say(f"worker(s) {spares} joined, but no outer round is left to join: they stay idle")
                ignored |= set(spares)
                continue
            try:
                await self._join_group(hr, spares, k0, metrics)
            except FusionError as exc:
                self.say(f"worker(s) {spares} could not join as a group: {exc}; they stay idle")
                metrics.write({"event": "join_failed", "workers": spares, "why": str(exc), "elapsed_s": round(hr.elapsed(), 4)})
                ignored |= set(spares)

    async def _join_barrier(self, hr: Any, g: int, pending: list[tuple[int, int, int]], metrics: JsonlWriter) -> None:
        """Group ``g`` at the end of round ``join_at - 1``: apply what it has not applied, then wait
        for the join to be done."""
        for _, f, r in sorted(pending, key=lambda p: (p[2], p[1])):
            await self._outer_sync(hr, g, f, r, 0, [r], metrics, send=False)
        pending.clear()
        async with hr.changed:
            hr.arrived.add(g)
            hr.changed.notify_all()
            while hr.join_at is not None and g in hr.alive:
                await hr.changed.wait()

    async def _join_group(self, hr: Any, workers: list[int], k0: int, metrics: JsonlWriter) -> None:
        began = time.perf_counter()
        self.say(f"worker(s) {workers} joined: a new group from outer round {k0}; the groups pause at the end of round {k0 - 1}")
        async with hr.changed:
            hr.join_at = k0
            hr.changed.notify_all()
            while not hr.alive <= hr.arrived:
                await hr.changed.wait()
        try:
            if not hr.alive:
                raise FusionError("every group left the run")
            index, source = await self._add_group(hr, workers, k0)
        finally:
            async with hr.changed:
                hr.join_at = None
                hr.arrived.clear()
                hr.changed.notify_all()
        hr.loops[index] = asyncio.create_task(self._group_loop(hr, index, metrics))
        event = {"event": "group_joined", "group": index, "workers": workers, "round": k0, "source_group": source,
                 "seconds": round(time.perf_counter() - began, 3), "elapsed_s": round(hr.elapsed(), 4)}
        metrics.write(event)
        self.status.event(event)
        self.say(f"group {index} (workers {workers}) joined at outer round {k0} in {event['seconds']:.1f} s, "
                 f"with group {source}'s outer weights and momentum")

    async def _add_group(self, hr: Any, workers: list[int], k0: int) -> tuple[int, int]:
        """Plan, assign and announce the new group; returns its index and the group its state came from."""
        c = self.cluster
        members = self.membership.members
        source = min(hr.alive)
        src = hr.runs[source]
        states = [await self._read_state(src, s.workers[0], outer=True) for s in src.plan.stages]
        plan = remap(make_plan(hr.graph, len(workers), schedule=c.schedule, micro_batches=c.micro_batches), workers)
        infos = {w: m.info for w, m in members.items()}
        plan = await asyncio.to_thread(place, hr.graph, plan, infos, self.say, self.task.refused_ops)
        programs = await asyncio.to_thread(validate_plan, hr.graph, plan)
        await asyncio.to_thread(check_message_sizes, hr.graph, plan)
        live = [g for g in hr.hier.groups if g.index in hr.alive]
        ref = min(live, key=lambda g: g.inner_steps)  # the slowest group's H: the new group's speed is not known yet
        index = max(g.index for g in hr.hier.groups) + 1
        hier = replace(hr.hier, groups=[*live, GroupPlan(index, plan, ref.inner_steps)])
        text = hier.to_json()
        addresses = {m.id: m.address for m in members.values()}
        clients = src.clients  # one dict, shared by every group's Run
        for w in workers:
            clients[w] = RpcClient(addresses[w], WORKER_SERVICE, c.token, tls=c.tls)
        run = Run(hr.graph, plan, clients, actions=programs)
        run.hier = text
        await self._assign(run, addresses, states, None, parse_codec(c.compress))
        if run.fed and self._group_batch() != self.train.batch_size:
            raise FusionError("--group-batch needs workers that read their own data")
        new = {str(w): addresses[w] for w in workers}
        data = {str(w): str(members[w].info["data_address"]) for w in workers if members[w].info.get("data_address")}
        old = [w for g in live for w in g.workers]
        await asyncio.gather(*(clients[w].call("Regroup", Regroup(text, new, data).to_wire(), timeout=c.step_timeout) for w in old))
        for r in hr.runs.values():
            r.hier = text
        hr.hier = hier
        hr.runs[index] = run
        hr.lengths[index] = list(hr.lengths[ref.index])
        hr.first_round[index] = hr.current[index] = k0
        longest = max(sum(x) for x in hr.lengths.values())
        hr.data_base[index] = (hr.n_data + len(hr.data_base)) * longest  # past every batch another group reads
        hr.alive.add(index)
        self.membership.spares -= set(workers)
        return index, source
