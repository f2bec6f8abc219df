"""Hierarchical mode on the coordinator: one step clock per group, outer syncs between them.

Each group (``schedule/hierarchy.py``) trains its own synchronous plan on its own data shard
(group ``g`` of ``G`` reads batches ``i * G + g``) as fast as its devices allow; nothing waits for
another group's steps. When a group reaches a fragment's sync point it sends that fragment's
pseudo-gradient (``OuterSync`` with ``send``), and then applies the average of a round: with
overlap the previous one (sent one round ago, so it is there), without overlap this one. Which
groups a round's average holds is decided here, once, for all groups: those that sent it; a group
that has not sent within a round's time (or died) is left out, and the others go on. A group whose
worker dies leaves the run; the others finish it. Between two rounds the groups can pause
(``hier_pauses.py``): for a checkpoint, and for workers that joined mid-run to form a new group.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

from fusionllm.compress.codecs import parse_codec
from fusionllm.core.config import TrainResult, lr_at
from fusionllm.core.errors import ConfigError, FusionError
from fusionllm.core.metrics import JsonlWriter
from fusionllm.graph.ir import OpGraph
from fusionllm.schedule.hierarchy import HierPlan, make_hier_plan, round_lengths, sync_offsets
from fusionllm.schedule.validate import validate_plan
from fusionllm.transport.control import (
    WORKER_SERVICE,
    OuterApply,
    OuterSync,
    OuterSynced,
    Step,
    StepDone,
)
from fusionllm.transport.rpc import RpcClient

from .capabilities import backend_of, place
from .config import Run, WorkerLost
from .hier_pauses import checkpoint_rounds, resume_round, wait_notified
from .limits import check_message_sizes
from .status import stage_rows
from .training import observe_policy, ratios_of


@dataclass
class HierRun:
    hier: HierPlan
    graph: OpGraph
    runs: dict[int, Run]  # group -> its synchronous run
    rounds: int
    alive: set[int]
    lengths: dict[int, list[int]] = field(default_factory=dict)  # group -> inner steps of each of its rounds
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    sent: dict[tuple[int, int], dict[int, float]] = field(default_factory=dict)  # (fragment, round) -> group -> tokens
    decided: dict[tuple[int, int], dict[int, float]] = field(default_factory=dict)
    round_s: dict[int, float] = field(default_factory=dict)  # the last round's wall time per group
    result: TrainResult = field(default_factory=TrainResult)
    steps: int = 0
    started: float = 0.0
    paused: float = 0.0  # seconds spent evaluating (not counted as training time)
    outer_bytes: dict[str, int] = field(default_factory=dict)  # pseudo-gradient bytes per link, whole run
    n_data: int = 1  # groups of the first plan: group g of them reads batches i * n_data + g
    first_round: dict[int, int] = field(default_factory=dict)  # a group that joined: the first round it takes part in
    current: dict[int, int] = field(default_factory=dict)  # group -> the round it is in
    data_base: dict[int, int] = field(default_factory=dict)  # a group that joined: its batches are data_base + i
    pauses: set[int] = field(default_factory=set)  # rounds before which every group pauses (hier_pauses.py)
    ckpt_rounds: set[int] = field(default_factory=set)  # the pauses that write a checkpoint
    join_at: int | None = None  # the pause at which the spares form a new group
    resumed: int = 0  # the last pause done
    arrived: set[int] = field(default_factory=set)  # groups waiting at the next pause
    loops: dict[int, asyncio.Task] = field(default_factory=dict)
    observed: set[int] = field(default_factory=set)  # groups whose AdaTopK policy has seen a step
    stopping: bool = False  # the run is over: the pauser ends

    def expected(self, r: int) -> set[int]:
        """The live groups that take part in round ``r`` (a group that joined later does not)."""
        return {g for g in self.alive if self.first_round.get(g, 0) <= r}

    def elapsed(self) -> float:
        return time.perf_counter() - self.started - self.paused


class HierarchicalMixin:
    """The coordinator's hierarchical half (``Coordinator`` mixes it in)."""

    # ---- planning and assignment -----------------------------------------------------------------
    def _group_batch(self) -> int:
        """Rows per inner step of every group (``--group-batch``; default ``--batch-size``)."""
        return self.cluster.group_batch or self.train.batch_size

    async def _setup_hier(self) -> HierRun:
        t, c = self.train, self.cluster
        batch = self._group_batch()
        if batch % c.micro_batches:
            raise ConfigError(f"--group-batch {batch} must be a multiple of --micro-batches {c.micro_batches}")
        if c.eval_every and (t.batch_size % batch):
            raise ConfigError(f"--group-batch {batch} must divide --batch-size {t.batch_size} (the validation batches are cut from it)")
        graph = await asyncio.to_thread(self.task.trace, batch // c.micro_batches)
        self.start_step = 0
        load = self._resume(graph) if c.resume else None  # the outer weights and momentum of a hierarchical checkpoint
        states = [] if load else [await asyncio.to_thread(self.task.initial_state)]
        addresses = {m.id: m.address for m in self.membership.members.values()}
        clients = {w: RpcClient(a, WORKER_SERVICE, c.token, tls=c.tls) for w, a in addresses.items()}
        infos = {w: m.info for w, m in self.membership.members.items()}
        if c.scheduler:
            hier = await self._schedule_hier(graph, clients)
        else:
            unknown = sorted({w for g in c.groups or [] for w in g} - set(addresses))
            if unknown:
                raise ConfigError(f"--groups names worker(s) {unknown}, but the workers are {sorted(addresses)}")
            hier = make_hier_plan(graph, c.groups or [], inner_steps=c.inner_steps or 4, fragments=c.fragments or 1, schedule=c.schedule,
                                  micro_batches=c.micro_batches, codec=c.outer_codec or "q4", outer_lr=c.outer_lr,
                                  outer_momentum=c.outer_momentum, overlap=c.overlap,
                                  delay_steps=c.overlap_steps or 0)
        runs: dict[int, Run] = {}
        graphs = {c.micro_batches: graph}  # a group whose plan has other micro-batches runs the model traced at their size
        for g in hier.groups:
            m = g.plan.micro_batches
            if m not in graphs:
                if batch % m:
                    raise FusionError(f"the planner gave group {g.index} {m} micro-batches, which does not divide the group batch {batch}")
                again = await asyncio.to_thread(self.task.trace, batch // m)
                if [(n.id, n.kind) for n in again.nodes] != [(n.id, n.kind) for n in graph.nodes]:
                    raise FusionError("the model traces differently at another micro-batch size; pass --micro-batches and --groups by hand")
                graphs[m] = again
            gg = graphs[m]
            g.plan = await asyncio.to_thread(place, gg, g.plan, infos, self.say, self.task.refused_ops)
            programs = await asyncio.to_thread(validate_plan, gg, g.plan)
            await asyncio.to_thread(check_message_sizes, gg, g.plan)
            runs[g.index] = Run(gg, g.plan, clients, actions=programs)
        text = hier.to_json()
        for run in runs.values():
            run.hier = text
        self._print_hier(hier, graph, addresses)
        codec = parse_codec(c.compress)
        if codec.kind == "adatopk":  # each group's own link policy, as a synchronous plan's
            await self._group_policies(graph, hier, runs, clients)
        if batch != t.batch_size:  # every group reads batches of its own size; validation: the same windows, in smaller batches
            self.data_spec = replace(self.data_spec, batch_size=batch, eval_batches=c.eval_batches * (t.batch_size // batch))
        await asyncio.gather(*(self._assign(run, addresses, states, load, codec) for run in runs.values()))
        if batch != t.batch_size and any(run.fed for run in runs.values()):
            raise FusionError("--group-batch needs workers that read their own data (some cannot: see above); leave it out")
        steps_per_round = max(g.inner_steps for g in hier.groups)
        rounds = max(1, math.ceil(t.steps / steps_per_round))
        self.plan_record = {
            "event": "plan", "sync": "hierarchical", "epoch": self.epoch, "rounds": rounds, "fragments": len(hier.fragments),
            "codec": hier.codec, "outer_lr": hier.outer_lr, "outer_momentum": hier.outer_momentum, "overlap": hier.overlap,
            "groups": [{"group": g.index, "workers": g.workers, "inner_steps": g.inner_steps, "stages": stage_rows(runs[g.index].graph, g.plan),
                        "schedule": g.plan.schedule, "micro_batches": g.plan.micro_batches,
                        "predicted_step_s": g.plan.meta.get("predicted_step_s")} for g in hier.groups],
            "predicted": {k: v for k, v in hier.meta.items() if k != "candidates"},
            "workers": {str(w): {"address": a, "backend": backend_of(infos[w]), "device": infos[w].device.kind, "in_plan": w in hier.workers}
                        for w, a in addresses.items()},
        }
        self.status.event(self.plan_record)
        base = min(g.inner_steps for g in hier.groups)
        lengths = {g.index: round_lengths(g.inner_steps, base, rounds, warmup=c.outer_warmup) for g in hier.groups}
        self.plan_record["round_lengths"] = {str(k): v for k, v in lengths.items()}
        ref = lengths[min(hier.groups, key=lambda g: g.inner_steps).index]  # steps are counted in the slowest group
        start = resume_round(ref, self.start_step) if load else 0
        if load:
            self.say(f"resuming the outer weights and momentum at outer round {start} of {len(ref)}")
        ckpt = checkpoint_rounds(ref, c.checkpoint_every)
        return HierRun(hier, graph, runs, len(ref), alive={g.index for g in hier.groups}, lengths=lengths, n_data=len(hier.groups),
                       current={g.index: start for g in hier.groups}, first_round={g.index: start for g in hier.groups},
                       pauses={p for p in ckpt if p > start}, ckpt_rounds=ckpt, resumed=start)

    async def _group_policies(self, graph: OpGraph, hier: HierPlan, runs: dict[int, Run], clients: dict[int, RpcClient]) -> None:
        from fusionllm.control.adatopk import adatopk_policy
        from fusionllm.schedule.plan import Request

        cost = await self._cost(graph, clients)
        for g in hier.groups:
            req = Request(self._group_batch(), self.task.items_per_row, g.plan.micro_batches)
            runs[g.index].policy, _ = await asyncio.to_thread(adatopk_policy, g.plan, cost, req)
            slow = {f"w{a}->w{b}": round(r, 4) for (a, b), r in runs[g.index].policy.ratios().items() if r < 1}
            self.say(f"  group {g.index} adatopk: compressed links {slow or 'none (no codec predicts a shorter step)'}")

    async def _schedule_hier(self, graph: OpGraph, clients: dict[int, RpcClient]) -> HierPlan:
        from fusionllm.control.hierarchy_planning import choose_hier_plan
        from fusionllm.schedule.plan import Request

        c = self.cluster
        hw = await self._hardware(clients)
        work = await asyncio.to_thread(self.task.estimate, graph)
        infos = {w: m.info for w, m in self.membership.members.items()}

        def placed(p: Any) -> Any:
            return place(graph, p, infos, lambda _: None, self.task.refused_ops)

        req = Request(self._group_batch(), self.task.items_per_row, c.micro_batches, c.schedule)
        hier, _ = await asyncio.to_thread(
            choose_hier_plan, graph, hw, c.scheduler, req, work=work, say=self.say, compress=str(parse_codec(c.compress)), place=placed,
            inner_steps=c.inner_steps, fragments=c.fragments, codec=c.outer_codec, outer_lr=c.outer_lr, outer_momentum=c.outer_momentum,
            overlap=c.overlap,
        )
        if c.overlap_steps is not None:
            hier.delay_steps = c.overlap_steps
        return hier

    def _print_hier(self, hier: HierPlan, graph: OpGraph, addresses: dict[int, str]) -> None:
        self.say(f"hierarchical plan: {len(hier.groups)} groups, {len(hier.fragments)} fragments, pseudo-gradients as {hier.codec}, "
                 f"outer Nesterov lr {hier.outer_lr} momentum {hier.outer_momentum}, "
                 + (f"averages applied {hier.delay_steps or 'a round of'} inner steps after their send" if hier.overlap else "blocking sync"))
        for g in hier.groups:
            stages = " | ".join(",".join(map(str, s.workers)) for s in g.plan.stages)
            self.say(f"  group {g.index}: workers [{stages}] ({len(g.plan.stages)} stages), {g.inner_steps} inner steps per round")
        for w in sorted(set(addresses) - set(hier.workers)):
            self.say(f"  worker {w} ({addresses[w]}): idle (in no group)")

    # ---- training --------------------------------------------------------------------------------
    async def _train_hier(self, hr: HierRun, metrics: JsonlWriter) -> TrainResult:
        hr.result = TrainResult(num_params=hr.graph.num_params())
        hr.started = time.perf_counter()
        hr.loops = {g: asyncio.create_task(self._group_loop(hr, g, metrics)) for g in hr.runs}
        watcher = asyncio.create_task(self._pauser(hr, metrics))
        try:
            while pending := [task for task in hr.loops.values() if not task.done()]:  # a group that joins adds a loop
                # the pauser too: a pause's work that fails (a checkpoint with no group left to write it) ends the run
                await asyncio.wait([*pending, *([watcher] if not watcher.done() else [])], return_when=asyncio.FIRST_COMPLETED)
                for task in [*hr.loops.values(), watcher]:
                    if task.done() and not task.cancelled() and task.exception() is not None:
                        raise task.exception()
        finally:
            hr.stopping = True
            for task in [*hr.loops.values(), watcher]:
                task.cancel()
            await asyncio.gather(*hr.loops.values(), watcher, return_exceptions=True)
        if not hr.alive:
            raise FusionError("every group left the run (see the messages above)")
        hr.result.elapsed_s = hr.elapsed()
        if self.cluster.checkpoint_every and hr.current:  # the end: every average applied, the same outer weights everywhere
            await self._checkpoint_hier(hr, hr.rounds, metrics)
        metrics.write({"event": "outer_bytes", "bytes": hr.outer_bytes, "tokens": hr.result.tokens})
        return hr.result

    async def _group_loop(self, hr: HierRun, g: int, metrics: JsonlWriter) -> None:
        try:
            await self._group_rounds(hr, g, metrics)
        except (WorkerLost, FusionError) as exc:
            await self._group_left(hr, g, exc, metrics)
            if not hr.alive:
                raise

    async def _group_left(self, hr: HierRun, g: int, exc: Exception, metrics: JsonlWriter) -> None:
        """Group ``g`` leaves the run (a worker of it lost, in its rounds or in a pause's checkpoint):
        the others go on without it; its workers are told to abort. Once per group."""
        if g not in hr.alive:
            return
        hr.alive.discard(g)
        async with hr.changed:
            hr.changed.notify_all()
        self.say(f"group {g} left the run: {exc}")
        left = {"event": "group_left", "group": g, "why": str(exc), "elapsed_s": round(hr.elapsed(), 4)}
        metrics.write(left)
        self.status.event(left)
        if hr.alive:
            with contextlib.suppress(FusionError):
                await asyncio.gather(*(hr.runs[g].clients[w].call("Abort", {}, timeout=5) for w in hr.runs[g].plan.workers),
                                     return_exceptions=True)

    async def _group_rounds(self, hr: HierRun, g: int, metrics: JsonlWriter) -> None:
        t, c = self.train, self.cluster
        gp = next(x for x in hr.hier.groups if x.index == g)
        run = hr.runs[g]
        n_frags = len(hr.hier.fragments)
        lengths = hr.lengths[g]
        total = sum(lengths)
        start = hr.first_round.get(g, 0)
        data_base = hr.data_base.get(g)
        tokens_per_step = self._group_batch() * self.task.items_per_row
        eval_n = self.task.eval_count(c.eval_batches) * (t.batch_size // self._group_batch()) if c.eval_every else 0
        delay = hr.hier.delay_of(gp)
        pending: list[tuple[int, int, int]] = []  # (inner step it is due after, fragment, round): averages not applied yet
        evaluate: int | None = None  # a round whose outer weights are evaluated once all its fragments are applied
        i = sum(lengths[:start])  # a group that joined takes the schedule (learning rate) where the others are
        for k in range(start, len(lengths)):
            h = lengths[k]
            hr.current[g] = k
            began = time.perf_counter()
            offsets = sync_offsets(h, n_frags)
            for j in range(h):
                lr = lr_at(min(t.steps - 1, i * t.steps // total), lr=t.lr, steps=t.steps, warmup=t.warmup)
                data_step = data_base + i if data_base is not None else i * hr.n_data + g
                await self._inner_step(hr, g, run, i, data_step, lr, k, metrics)
                i += 1
                for f, off in enumerate(offsets):
                    if off == j + 1:
                        await self._outer_sync(hr, g, f, k, h * tokens_per_step, [], metrics)
                        pending.append((i + min(delay, h), f, k))
                for due in [p for p in pending if p[0] <= i]:
                    pending.remove(due)
                    await self._outer_sync(hr, g, due[1], due[2], 0, [due[2]], metrics, send=False)
                if evaluate is not None and not any(r <= evaluate for _, _, r in pending):
                    await self._evaluate_outer(hr, run, eval_n, evaluate, metrics)  # the outer weights of whole rounds
                    evaluate = None
            hr.round_s[g] = time.perf_counter() - began
            if eval_n and g == min(hr.alive) and (i // c.eval_every) > ((i - h) // c.eval_every) and k + 1 < len(lengths):
                evaluate = k  # once every fragment of this round is applied
            if k + 1 in hr.pauses:  # a checkpoint or a join: every average so far is applied, then the groups wait
                await self._pause(hr, g, k + 1, pending, metrics)
                if evaluate is not None:
                    await self._evaluate_outer(hr, run, eval_n, evaluate, metrics)
                    evaluate = None
        last = sync_offsets(lengths[-1], n_frags)
        end = len(lengths)
        for f, off in enumerate(last):  # the end: what the last round left unsent goes out, every average is applied
            tail = (lengths[-1] - off) * tokens_per_step
            rounds = sorted(r for _, pf, r in pending if pf == f) + ([end] if tail else [])
            await self._outer_sync(hr, g, f, end, tail, rounds, metrics, send=tail > 0, announce=True)
        if eval_n and g == min(hr.alive):
            await self._evaluate_outer(hr, run, eval_n, end, metrics)

    async def _inner_step(self, hr: HierRun, g: int, run: Run, i: int, data_step: int, lr: float, k: int, metrics: JsonlWriter) -> None:
        batch = self.task.batch(data_step) if run.fed else None
        calls = {w: self._call_step(run, w, Step(data_step, lr, self._inputs_for(run, w, *batch) if batch is not None and w in run.fed else None,
                                                 ratios_of(run.policy, w)))
                 for w in run.plan.workers}
        replies: dict[int, StepDone] = await self._step_calls(run, calls)
        if any(rep.failed is not None or rep.aborted for rep in replies.values()):
            await self._raise_if_lost(run, "a step failed")
        self._check_failures(run, data_step, replies)
        losses = {int(mb): v for rep in replies.values() for mb, v in rep.losses.items()}
        if len(losses) != run.plan.micro_batches:
            raise FusionError(f"group {g} step {i}: got losses of micro-batches {sorted(losses)}, expected {run.plan.micro_batches}")
        loss = sum(losses[m] for m in sorted(losses)) / len(losses)
        hr.result.losses.append(loss)
        hr.result.tokens += self._group_batch() * self.task.items_per_row
        elapsed = hr.elapsed()
        record: dict[str, Any] = {
            "step": hr.steps, "steps_total": sum(sum(hr.lengths[x][hr.first_round.get(x, 0):]) for x in hr.alive),
            "group": g, "round": k, "inner_step": i, "loss": loss, "tokens": hr.result.tokens,
            "elapsed_s": round(elapsed, 4), "tokens_per_s": round(hr.result.tokens / max(elapsed, 1e-9), 1), "lr": lr,
            "grad_norm": next(iter(replies.values())).grad_norm, "step_s": round(max(rep.seconds for rep in replies.values()), 4),
            "bytes": self._link_bytes(run, replies), "cpu_s": {str(w): rep.cpu_s for w, rep in replies.items()},
        }
        if run.policy is not None:
            observe_policy(run.policy, replies, record, learn=g in hr.observed)  # the first step's sends also open the connections
            hr.observed.add(g)
        hr.steps += 1
        metrics.write(record)
        self.status.step(record)
        self.on_step(record)

    async def _outer_sync(self, hr: HierRun, g: int, f: int, r: int, tokens: int, apply: list[int], metrics: JsonlWriter, *,
                          send: bool = True, announce: bool | None = None) -> None:
        """Send fragment ``f``'s delta of round ``r`` (``send``), tell the other groups it is there or
        that there is none (``announce``, default ``send``), then apply the ``apply`` rounds' averages."""
        run = hr.runs[g]
        began = time.perf_counter()
        sent: dict[str, int] = {}

        async def call(w: int, msg: OuterSync) -> OuterSynced:
            return OuterSynced.from_wire(await run.clients[w].call("OuterSync", msg.to_wire(), timeout=self.cluster.step_timeout))

        if send:
            replies = await self._step_calls(run, {w: call(w, OuterSync(f, r, True)) for w in run.plan.workers})
            for w, rep in replies.items():
                for dst, n in rep.bytes_to.items():
                    sent[f"w{w}->w{dst}"] = sent.get(f"w{w}->w{dst}", 0) + n
                    hr.outer_bytes[f"w{w}->w{dst}"] = hr.outer_bytes.get(f"w{w}->w{dst}", 0) + n
        if send if announce is None else announce:
            async with hr.changed:
                hr.sent.setdefault((f, r), {})[g] = float(tokens if send else 0)
                hr.changed.notify_all()
        applies = []
        for j in apply:
            groups = await self._decide(hr, f, j, g, metrics)
            if groups:
                applies.append(OuterApply(j, {str(x): w for x, w in groups.items()}))
        if applies:
            await self._step_calls(run, {w: call(w, OuterSync(f, r, False, applies)) for w in run.plan.workers})
        outer = {"event": "outer", "group": g, "fragment": f, "round": r, "sent": send,
                 "applied": {str(a.round): a.groups for a in applies}, "bytes": sent, "seconds": round(time.perf_counter() - began, 4),
                 "elapsed_s": round(hr.elapsed(), 4)}
        metrics.write(outer)
        self.status.event(outer)

    async def _decide(self, hr: HierRun, f: int, r: int, asking: int, metrics: JsonlWriter) -> dict[int, float]:
        """The groups whose deltas of round ``r`` of fragment ``f`` are averaged: decided once, by
        the first group that needs it, after every live group sent it or a round's time passed."""
        key = (f, r)
        async with hr.changed:
            if key not in hr.decided:
                loop = asyncio.get_running_loop()
                patience = max(self.cluster.dead_after_s, 2.0 * hr.round_s.get(asking, time.perf_counter() - hr.started))
                deadline = loop.time() + patience
                while not hr.expected(r) <= set(hr.sent.get(key, {})):
                    left = deadline - loop.time()
                    if left <= 0:
                        break
                    await wait_notified(hr.changed, left)
                got = hr.sent.get(key, {})
                hr.decided[key] = {x: w for x, w in got.items() if x in hr.alive and w > 0}
                late = sorted(hr.expected(r) - set(got))
                if late:
                    self.say(f"outer round {r} of fragment {f}: group(s) {late} left out (not there within {patience:.1f} s)")
                    out = {"event": "left_out", "fragment": f, "round": r, "groups": late, "elapsed_s": round(hr.elapsed(), 4)}
                    metrics.write(out)
                    self.status.event(out)
            return hr.decided[key]

    async def _evaluate_outer(self, hr: HierRun, run: Run, eval_n: int, k: int, metrics: JsonlWriter) -> None:
        paused = time.perf_counter()
        val = await self._evaluate(run, eval_n, hr.steps, outer=True)
        hr.paused += time.perf_counter() - paused
        hr.result.val_losses.append((hr.steps, val))
        record = {"event": "eval", "step": hr.steps, "round": k, "val_loss": val, "tokens": hr.result.tokens, "elapsed_s": round(hr.elapsed(), 4)}
        if run.val_metric is not None:
            record[f"val_{self.task.metric_name}"] = run.val_metric
            hr.result.val_metrics.append((hr.steps, run.val_metric))
        metrics.write(record)
        self.status.event(record)
