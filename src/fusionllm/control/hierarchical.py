"""Hierarchical mode on the coordinator: one step clock per group, outer syncs between them.

Each group (``schedule/hierarchy.py``) trains its own synchronous plan on its own data shard
(group ``g`` of ``G`` reads batches ``i * G + g``) as fast as its devices allow; nothing waits for
another group's steps. Each inner step is the synchronous run's step (``steps.py``): the same
guards, retry, skip, strikes and eviction, and the same step record (plus group, round, inner
step). When a group reaches a fragment's sync point it sends that fragment's pseudo-gradient
(``OuterSync`` with ``send``), and then applies the average of a round: with overlap the previous
one (sent one round ago, so it is there), without overlap this one. Which groups a round's average
holds is decided here, once, for all groups: those that sent it; a group that has not sent within
a round's time (or died) is left out, and the others go on. A group whose worker dies or is
evicted leaves the run; its other workers form a new group at the next pause (``hier_pauses.py``),
from the outer weights; the other groups finish the run meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from fusionllm.compress.budget import budget_cap
from fusionllm.core.config import TrainResult, lr_at
from fusionllm.core.errors import FusionError
from fusionllm.schedule.hierarchy import sync_offsets
from fusionllm.transport.control import OuterApply, OuterSync, OuterSynced

from .config import Evict, Run, WorkerLost
from .context import RunContext
from .hier_pauses import Pauses
from .hier_setup import GroupSetup, HierRun
from .outer_guard import OuterGuard, OuterStop
from .recovery import evict_event
from .rounds import wait_notified
from .state import Checkpoints
from .steps import StepRunner, slower_than_planned, step_record
from .workers import Liveness


class Groups:
    """The rounds of every group of a hierarchical run, their outer syncs and evaluations."""

    def __init__(self, ctx: RunContext, group_setup: GroupSetup, checkpoints: Checkpoints, live: Liveness, runner: StepRunner,
                 send_away: Callable[[Run, set[int]], Awaitable[dict[int, str]]], replans: Callable[[], int] = lambda: 0) -> None:
        """``send_away``: tells evicted workers to leave (``Recovery.send_away``); ``replans()``: the
        run's re-plans so far (``--max-replans``)."""
        self.ctx, self.checkpoints, self.live, self.runner, self.send_away = ctx, checkpoints, live, runner, send_away
        self.replans = replans
        self.group_batch = group_setup.group_batch()
        self.outer_guard = OuterGuard(ctx, ctx.cluster.outer_aggregate)  # checked outer steps: strikes last the whole run
        self.pauses = Pauses(ctx, group_setup, checkpoints, live, self)

    async def train(self, hr: HierRun) -> TrainResult:
        """Every group's rounds, and the pauser, until the last group ends its last round."""
        hr.result = TrainResult(num_params=hr.graph.num_params())
        self.ctx.segment()
        hr.started = time.perf_counter()
        hr.loops = {g: self.start(hr, g) for g in hr.runs}
        watcher = asyncio.create_task(self.pauses.pauser(hr))
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
        if self.ctx.cluster.checkpoint_every and hr.current:  # the end: every average applied, the same outer weights everywhere
            await self.pauses.checkpoint(hr, hr.end_at if hr.end_at is not None else hr.rounds)
        self.ctx.metrics.write({"event": "outer_bytes", "bytes": hr.outer_bytes, "tokens": hr.result.tokens})
        return hr.result

    def start(self, hr: HierRun, g: int) -> asyncio.Task:
        """Group ``g``'s rounds as a task (a group that joins mid-run gets one too)."""
        return asyncio.create_task(self.loop(hr, g))

    async def loop(self, hr: HierRun, g: int) -> None:
        """Group ``g``'s rounds. A worker of it evicted or lost takes the group out of the run, as in a
        synchronous run's plan; its other workers become spares, which form a new group at the next
        pause from the outer weights (``hier_pauses.py``), the way a synchronous run re-plans."""
        try:
            await self.rounds(hr, g)
        except OuterStop:
            raise  # --numeric-guard stop: the run ends, not only this group
        except Evict as ev:
            await self.evicted(hr, g, ev)
            if not hr.alive:
                raise
        except (WorkerLost, FusionError) as exc:
            await self.left(hr, g, exc, gone=set(exc.workers) if isinstance(exc, WorkerLost) else None)
            if not hr.alive:
                raise

    async def evicted(self, hr: HierRun, g: int, ev: Evict) -> None:
        """Evict ``ev.workers`` (told to leave, out of the membership) and take their group out."""
        began = time.perf_counter()
        run = hr.runs[g]
        self.ctx.say(f"group {g}: evicting worker(s) {sorted(ev.workers)}: {ev.why}")
        addresses = await self.send_away(run, ev.workers)
        await self.left(hr, g, ev, gone=set(ev.workers))
        self.ctx.membership.lose(set(ev.workers))
        event = evict_event(ev, addresses, time.perf_counter() - began, workers_left=len(self.ctx.membership.members), group=g)
        self.ctx.event(event)

    async def left(self, hr: HierRun, g: int, exc: Exception, *, gone: set[int] | None = None) -> None:
        """Group ``g`` leaves the run (a worker of it lost, in its rounds or in a pause's checkpoint):
        the others go on without it; its workers are told to abort. ``gone``: the workers to blame
        (lost or evicted); the group's others become spares that join again at the next pause (None:
        none do). Once per group."""
        if g not in hr.alive:
            return
        run = hr.runs[g]
        others = [w for w in run.plan.workers if w not in (set(run.plan.workers) if gone is None else gone)]
        hr.alive.discard(g)
        rejoin = bool(others and hr.alive)
        if rejoin:  # before any await: no group passes the join's round, which waits for them (``leaving``)
            self.pauses.schedule_join(hr, others)
            hr.leaving += 1
        async with hr.changed:
            hr.changed.notify_all()
        self.ctx.say(f"group {g} left the run: {exc}")
        members = self.ctx.membership.members
        self.ctx.event({"event": "group_left", "group": g, "why": str(exc), "workers": sorted(run.plan.workers),
                        "addresses": {str(w): members[w].address for w in sorted(run.plan.workers) if w in members},
                        "elapsed_s": round(self.ctx.run_seconds(hr.elapsed()), 4)})
        if rejoin:  # alive and not to blame: they train on in a new group from the next pause
            try:
                back = set(others) - await self.live.abort(run, others)
                self.ctx.membership.spares |= back
            finally:
                async with hr.changed:
                    hr.leaving -= 1
                    hr.changed.notify_all()
        elif hr.alive:
            with contextlib.suppress(FusionError):
                await asyncio.gather(*(run.clients[w].call_retrying("Abort", {}, within=5, timeout=5) for w in run.plan.workers), return_exceptions=True)

    async def rounds(self, hr: HierRun, g: int) -> None:
        """Group ``g``'s inner steps, outer syncs, evaluations and pauses, round after round."""
        t, c = self.ctx.train, self.ctx.cluster
        gp = next(x for x in hr.hier.groups if x.index == g)
        run = hr.runs[g]
        n_frags = len(hr.hier.fragments)
        lengths = hr.lengths[g]
        total = sum(lengths)
        start = hr.first_round.get(g, 0)
        data_base = hr.data_base.get(g)
        tokens_per_step = self.group_batch * self.ctx.task.items_per_row
        eval_n = self.ctx.eval_count() * (t.batch_size // self.group_batch)
        delay = hr.hier.delay_of(gp)
        pending: list[tuple[int, int, int]] = []  # (inner step it is due after, fragment, round): averages not applied yet
        evaluate: int | None = None  # a round whose outer weights are evaluated once all its fragments are applied
        i = sum(lengths[:start])  # a group that joined takes the schedule (learning rate) where the others are
        rounds_done = start
        for k in range(start, len(lengths)):
            if hr.end_at is not None and k >= hr.end_at:  # a re-plan: every group ends here (phases.py plans again)
                break
            h = lengths[k]
            hr.current[g] = k
            began = time.perf_counter()
            offsets = sync_offsets(h, n_frags)
            for j in range(h):
                at = min(t.steps - 1, hr.first + i * (hr.last - hr.first) // total)  # where the group is in the schedule
                lr = lr_at(at, lr=t.lr, steps=t.steps, warmup=t.warmup)
                data_step = data_base + i if data_base is not None else hr.data_from + i * hr.n_data + g
                await self.inner_step(hr, g, run, i, data_step, lr, k, cap=budget_cap(at, t.steps))
                i += 1
                for f, off in enumerate(offsets):
                    if off == j + 1:
                        await self.outer_sync(hr, g, f, k, h * tokens_per_step, [])
                        pending.append((i + min(delay, h), f, k))
                for due in [p for p in pending if p[0] <= i]:
                    pending.remove(due)
                    await self.outer_sync(hr, g, due[1], due[2], 0, [due[2]], send=False)
                if evaluate is not None and not any(r <= evaluate for _, _, r in pending):
                    await self.evaluate_outer(hr, run, eval_n, evaluate)  # the outer weights of whole rounds
                    evaluate = None
            hr.round_s[g] = time.perf_counter() - began
            if eval_n and g == min(hr.alive) and ((hr.first + i) // c.eval_every) > ((hr.first + i - h) // c.eval_every) and k + 1 < len(lengths):
                evaluate = k  # once every fragment of this round is applied
            if k + 1 in hr.pauses:  # a checkpoint or a join: every average so far is applied, then the groups wait
                await self.pauses.pause(hr, g, k + 1, pending)
                if evaluate is not None:
                    await self.evaluate_outer(hr, run, eval_n, evaluate)
                    evaluate = None
            rounds_done = k + 1
        if rounds_done == start:  # joined at the round where the run ends: nothing to send
            return
        last = sync_offsets(lengths[rounds_done - 1], n_frags)
        end = rounds_done
        for f, off in enumerate(last):  # the end: what the last round left unsent goes out, every average is applied
            tail = (lengths[rounds_done - 1] - off) * tokens_per_step
            rounds = sorted(r for _, pf, r in pending if pf == f) + ([end] if tail else [])
            await self.outer_sync(hr, g, f, end, tail, rounds, send=tail > 0, announce=True)
        if eval_n and g == min(hr.alive):
            await self.evaluate_outer(hr, run, eval_n, end)

    async def inner_step(self, hr: HierRun, g: int, run: Run, i: int, data_step: int, lr: float, k: int, cap: float = 1.0) -> None:
        """One inner step of group ``g``: the same step as a synchronous run's (``steps.py``), guards,
        retry, skip, strikes and eviction included."""
        self.evict_if_struck(hr, g)
        done = await self.runner.run(run, data_step, lr, group=g, cap=cap)
        hr.next_data = max(hr.next_data, data_step + 1)
        hr.result.tokens += self.group_batch * self.ctx.task.items_per_row  # a skipped step's batch is spent too
        if done is None:
            return
        hr.result.losses.append(done.loss)
        elapsed, tokens = self.ctx.trained(hr.elapsed(), hr.result.tokens)
        record = step_record(run, done, step=hr.steps, lr=lr, tokens=tokens, elapsed=elapsed, compress=self.ctx.cluster.compress, rows=self.group_batch)
        record.group, record.round, record.inner_step = g, k, hr.first + i
        record.steps_total = hr.first + sum(sum(hr.lengths[x][hr.first_round.get(x, 0):]) for x in hr.alive)
        hr.steps += 1
        self.ctx.step(record)
        self.check_plan(hr, g, run)

    def check_plan(self, hr: HierRun, g: int, run: Run) -> None:
        """A group whose last 8 steps took far longer than they should (``steps.slower_than_planned``):
        every group ends at the next round boundary and the run is planned again (``phases.py``),
        as a synchronous run re-plans."""
        c = self.ctx.cluster
        if hr.end_at is not None or not c.scheduler or self.replans() >= c.max_replans:
            return
        why = slower_than_planned(run, c.replan_factor)
        if why is not None:
            hr.end_at = max(hr.current[x] for x in hr.alive) + 1  # no group has started it yet
            hr.replan_why = f"group {g}'s {why}"
            self.ctx.say(f"re-planning at outer round {hr.end_at}: {hr.replan_why}")

    @staticmethod
    def evict_if_struck(hr: HierRun, g: int) -> None:
        """Group ``g``'s pseudo-gradients were refused ``--evict-after`` times (``outer_guard.py``): it
        is evicted from its own rounds, as a worker blamed for bad tensors is."""
        ev = hr.evicting.pop(g, None)
        if ev is not None:
            raise ev

    async def outer_sync(self, hr: HierRun, g: int, f: int, r: int, tokens: int, apply: list[int], *,
                          send: bool = True, announce: bool | None = None) -> None:
        """Send fragment ``f``'s delta of round ``r`` (``send``), tell the other groups it is there or
        that there is none (``announce``, default ``send``), then apply the ``apply`` rounds' averages."""
        run = hr.runs[g]
        began = time.perf_counter()
        sent: dict[str, int] = {}
        self.evict_if_struck(hr, g)

        async def call(w: int, msg: OuterSync) -> OuterSynced:
            c = self.ctx.cluster  # a dropped link is ridden out: the worker answers a repeat with the same run
            return OuterSynced.from_wire(await run.clients[w].call_retrying("OuterSync", msg.to_wire(), within=c.step_timeout, timeout=c.step_timeout))

        if send:
            replies = await self.live.calls(run, {w: call(w, OuterSync(f, r, True)) for w in run.plan.workers})
            for w, rep in replies.items():
                for dst, n in rep.bytes_to.items():
                    sent[f"w{w}->w{dst}"] = sent.get(f"w{w}->w{dst}", 0) + n
                    hr.outer_bytes[f"w{w}->w{dst}"] = hr.outer_bytes.get(f"w{w}->w{dst}", 0) + n
        if send if announce is None else announce:
            async with hr.changed:
                hr.sent.setdefault((f, r), {})[g] = float(tokens if send else 0)
                hr.changed.notify_all()
        applies = []
        for j in apply:  # one at a time: the checks of round j wait until every group applied round j - 1
            groups = await self.decide(hr, f, j, g)
            self.evict_if_struck(hr, g)
            scale = {str(x): v for x, v in hr.scales.get((f, j), {}).items() if v != 1.0}
            # also with no group in it: the workers drop the round's deltas
            one = OuterApply(j, {str(x): w for x, w in groups.items()}, step=hr.step_at(j + 1), scale=scale,
                             aggregate="trimmed" if self.ctx.cluster.outer_aggregate == "trimmed" else "mean")
            await self.live.calls(run, {w: call(w, OuterSync(f, r, False, [one])) for w in run.plan.workers})
            applies.append(one)
        self.ctx.event({"event": "outer", "group": g, "fragment": f, "round": r, "sent": send,
                       "applied": {str(a.round): a.groups for a in applies}, "bytes": sent, "seconds": round(time.perf_counter() - began, 4),
                       "elapsed_s": round(self.ctx.run_seconds(hr.elapsed()), 4)})

    async def decide(self, hr: HierRun, f: int, r: int, asking: int) -> dict[int, float]:
        """The groups whose deltas of round ``r`` of fragment ``f`` are averaged: decided once, by
        the first group that needs it, after every live group sent it or a round's time passed, and
        after their deltas were checked (``outer_guard.py``); the others wait for that decision."""
        key = (f, r)
        async with hr.changed:
            if key in hr.decided:
                return hr.decided[key]
            waiting = hr.deciding.get(key)
            if waiting is None:
                hr.deciding[key] = decision = asyncio.get_running_loop().create_future()
        if waiting is not None:
            await asyncio.shield(waiting)
            return hr.decided[key]
        groups: dict[int, float] = {}
        scales: dict[int, float] = {}
        try:
            async with hr.changed:
                groups = await self.senders(hr, f, r, asking)
            # the checks run outside the lock: a group that applies an earlier round meanwhile is not held up (they wait for it)
            groups, scales = await self.outer_guard.check(hr, f, r, groups)
        finally:
            hr.decided[key], hr.scales[key] = groups, scales
            hr.deciding.pop(key, None)
            decision.set_result(None)
        return groups

    async def senders(self, hr: HierRun, f: int, r: int, asking: int) -> dict[int, float]:
        """The live groups that sent round ``r`` of fragment ``f`` within a round's time (the caller
        holds ``hr.changed``)."""
        loop = asyncio.get_running_loop()
        patience = max(self.ctx.cluster.dead_after_s, 2.0 * hr.round_s.get(asking, time.perf_counter() - hr.started))
        deadline = loop.time() + patience
        while not hr.expected(r) <= set(hr.sent.get((f, r), {})):
            left = deadline - loop.time()
            if left <= 0:
                break
            await wait_notified(hr.changed, left)
        got = hr.sent.get((f, r), {})
        late = sorted(hr.expected(r) - set(got))
        if late:
            self.ctx.say(f"outer round {r} of fragment {f}: group(s) {late} left out (not there within {patience:.1f} s)")
            self.ctx.event({"event": "left_out", "fragment": f, "round": r, "groups": late, "elapsed_s": round(self.ctx.run_seconds(hr.elapsed()), 4)})
        return {x: w for x, w in got.items() if x in hr.alive and w > 0}

    async def evaluate_outer(self, hr: HierRun, run: Run, eval_n: int, k: int) -> None:
        """The validation loss of the outer weights of whole rounds, in ``run``'s pipeline."""
        paused = time.perf_counter()
        val = await self.live.guard(run, self.checkpoints.evaluate(run, eval_n, hr.steps, outer=True))
        hr.paused += time.perf_counter() - paused
        hr.result.val_losses.append((hr.steps, val))
        elapsed, tokens = self.ctx.trained(hr.elapsed(), hr.result.tokens)
        record = {"event": "eval", "step": hr.steps, "round": k, "val_loss": val, "tokens": tokens, "elapsed_s": round(elapsed, 4)}
        if run.val_metric is not None:
            record[f"val_{self.ctx.task.metric_name}"] = run.val_metric
            hr.result.val_metrics.append((hr.steps, run.val_metric))
        self.ctx.event(record)
