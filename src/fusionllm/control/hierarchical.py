"""The one round loop of every grouping: one step clock per group, outer syncs between groups.

A grouping of one group (``hier_setup.one_group``) runs here too: a round of it is one step, with
no outer sync and no pauser; its step records hold the evaluations due at their steps, the
checkpoints of ``--checkpoint-every`` follow them, and what its plan cannot go on from (a lost or
evicted worker, a plan far slower than predicted: ``Replan``, a stop) is raised to ``phases.py``,
which plans the same group again (``recovery.py``). With several groups:

Each group (``schedule/hierarchy.py``) trains its own synchronous plan on its own data shard
(group ``g`` of ``G`` reads batches ``i * G + g``) as fast as its devices allow; nothing waits for
another group's steps. Each inner step is the synchronous run's step (``steps.py``): the same
guards, retry, skip, strikes and eviction, and the same step record (plus group, round, inner
step), counted in the user's steps (``rounds.RoundClock``). When a group reaches a fragment's sync
point it sends that fragment's pseudo-gradient (``OuterSync`` with ``send``), and then applies the
average of a round: with overlap the previous one (sent one round ago, so it is there), without
overlap this one. Which groups a round's average holds is decided once, for all groups
(``outer_rounds.py``): those that sent it; a group that has not sent within a round's time (or
died) is left out, and the others go on. A group whose worker dies or is
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
from fusionllm.core.metrics import StepRecord
from fusionllm.schedule.hierarchy import sync_offsets

from .config import Evict, Replan, Run, WorkerLost
from .context import RunContext
from .hier_pauses import Pauses
from .hier_setup import GroupingRun, GroupSetup
from .outer_eval import Part
from .outer_guard import OuterGuard, OuterStop
from .outer_rounds import OuterRounds
from .recovery import evict_event
from .state import Checkpoints
from .steps import StepRunner, replan_due, step_record
from .workers import Liveness


class Groups:
    """The rounds of every group of a grouping (one, or several with their outer syncs and pauses) and their evaluations."""

    def __init__(self, ctx: RunContext, checkpoints: Checkpoints, live: Liveness, runner: StepRunner,
                 send_away: Callable[[Run, set[int]], Awaitable[dict[int, str]]], replans: Callable[[], int] = lambda: 0, *,
                 group_setup: GroupSetup | None = None, stop_if_asked: Callable[[int], None] = lambda _: None,
                 observe: Callable[[Run, StepRecord, int, bool], Awaitable[None]] | None = None) -> None:
        """``send_away``: tells evicted workers to leave (``Recovery.send_away``); ``replans()``: the
        run's re-plans so far (``--max-replans``); ``group_setup``: several groups' set-up (their batch,
        and the joins of their pauses; None: one group, which reads the run's batch and never pauses);
        ``stop_if_asked(step)``: raises between two steps of one group once a stop was asked (``restart.py``);
        ``observe(run, record, rows, one)``: sees every step record before it is written (the calibration
        of predictions and the finalists' measurements, ``phases.py``)."""
        self.ctx, self.checkpoints, self.live, self.runner, self.send_away = ctx, checkpoints, live, runner, send_away
        self.replans, self.stop_if_asked, self.observe = replans, stop_if_asked, observe
        self.group_batch = group_setup.group_batch() if group_setup is not None else ctx.train.batch_size
        self.outer_guard = OuterGuard(ctx, ctx.cluster.outer_aggregate)  # checked outer steps: strikes last the whole grouping
        self.outer = OuterRounds(ctx, live, self.outer_guard)
        self.pauses = Pauses(ctx, group_setup, checkpoints, live, self) if group_setup is not None else None

    async def train(self, hr: GroupingRun) -> TrainResult:
        """Every group's rounds, and the pauser of several, until the last group ends its last round.
        One group (``hr.hier`` None) raises what its plan cannot go on from (``WorkerLost``, ``Evict``,
        ``Replan``, a stop's ``Interrupted``) to ``phases.py``, which makes the next plan."""
        if hr.hier is None and self.ctx.cluster.eval_every and self.ctx.eval_count() == 0:
            t = self.ctx.train
            raise FusionError(f"the validation split holds no whole batch of {t.batch_size} x {t.seq_len} tokens: use --eval-every 0 or more data")
        hr.result = TrainResult(num_params=hr.graph.num_params())
        self.ctx.segment()
        hr.started = time.perf_counter()
        if self.pauses is None:  # one group: its rounds (one step each) and nothing beside them
            for g in hr.runs:
                await self.rounds(hr, g)
            hr.result.elapsed_s = hr.elapsed()
            return hr.result
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
        if self.ctx.cluster.checkpoint_every and hr.clock.current:  # the end: every average applied, the same outer weights everywhere
            await self.pauses.checkpoint(hr, hr.clock.end_at if hr.clock.end_at is not None else hr.clock.rounds)
        self.ctx.metrics.write({"event": "outer_bytes", "bytes": self.outer.outer_bytes, "tokens": hr.result.tokens})
        return hr.result

    def start(self, hr: GroupingRun, g: int) -> asyncio.Task:
        """Group ``g``'s rounds as a task (a group that joins mid-run gets one too)."""
        return asyncio.create_task(self.loop(hr, g))

    async def loop(self, hr: GroupingRun, g: int) -> None:
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

    async def evicted(self, hr: GroupingRun, g: int, ev: Evict) -> None:
        """Evict ``ev.workers`` (told to leave, out of the membership) and take their group out."""
        began = time.perf_counter()
        run = hr.runs[g]
        self.ctx.say(f"group {g}: evicting worker(s) {sorted(ev.workers)}: {ev.why}")
        addresses = await self.send_away(run, ev.workers)
        await self.left(hr, g, ev, gone=set(ev.workers))
        self.ctx.membership.lose(set(ev.workers))
        event = evict_event(ev, addresses, time.perf_counter() - began, workers_left=len(self.ctx.membership.members), group=g)
        self.ctx.event(event)

    async def left(self, hr: GroupingRun, g: int, exc: Exception, *, gone: set[int] | None = None) -> None:
        """Group ``g`` leaves the run (a worker of it lost, in its rounds or in a pause's checkpoint):
        the others go on without it; its workers are told to abort. ``gone``: the workers to blame
        (lost or evicted); the group's others become spares that join again at the next pause (None:
        none do). Once per group."""
        if g not in hr.alive:
            return
        run = hr.runs[g]
        others = [w for w in run.plan.workers if w not in (set(run.plan.workers) if gone is None else gone)]
        hr.alive.discard(g)
        hr.evals.write(self.ctx, hr.result, hr.elapsed(), hr.evals.left(hr.alive))  # those that waited on its share alone
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

    async def rounds(self, hr: GroupingRun, g: int) -> None:
        """Group ``g``'s inner steps, outer syncs, evaluations and pauses, round after round."""
        t, c = self.ctx.train, self.ctx.cluster
        run = hr.runs[g]
        one = hr.hier is None  # one group: no fragment, no outer sync; it evaluates into its step records
        n_frags = 0 if one else len(hr.hier.fragments)
        lengths = hr.clock.lengths[g]
        start = hr.clock.first_round.get(g, 0)
        tokens_per_step = self.group_batch * self.ctx.task.items_per_row
        eval_n = self.ctx.eval_count() * (t.batch_size // self.group_batch)
        delay = 0 if one else hr.hier.delay_of(next(x for x in hr.hier.groups if x.index == g))
        pending: list[tuple[int, int, int]] = []  # (inner step it is due after, fragment, round): averages not applied yet
        evaluate: int | None = None  # a round whose outer weights are evaluated once all its fragments are applied
        i = sum(lengths[:start])  # a group that joined takes the schedule (learning rate) where the others are
        rounds_done = start
        for k in range(start, len(lengths)):
            if hr.clock.end_at is not None and k >= hr.clock.end_at:  # a re-plan: every group ends here (phases.py plans again)
                break
            h = lengths[k]
            hr.clock.current[g] = k
            began = time.perf_counter()
            offsets = sync_offsets(h, n_frags)
            for j in range(h):
                at = hr.clock.user_step(g, i)  # where the group is on the run's steps (the schedule, the records)
                self.stop_if_asked(at)  # Ctrl+C or SIGTERM: stop here, between two steps (restart.py)
                lr = lr_at(min(t.steps - 1, at) + hr.clock.shift, lr=t.lr, steps=t.steps, warmup=t.warmup)
                await self.inner_step(hr, g, run, i, hr.data.batch(g, i), lr, k, user_step=at, cap=budget_cap(min(t.steps - 1, at), t.steps))
                i += 1
                for f, off in enumerate(offsets):
                    if off == j + 1:
                        await self.outer.sync(hr, g, f, k, h * tokens_per_step, [])
                        pending.append((i + min(delay, h), f, k))
                for due in [p for p in pending if p[0] <= i]:
                    pending.remove(due)
                    await self.outer.sync(hr, g, due[1], due[2], 0, [due[2]], send=False)
                if evaluate is not None and not any(r <= evaluate for _, _, r in pending):
                    await self.evaluate_outer(hr, g, run, eval_n, evaluate + 1)  # the outer weights of whole rounds
                    evaluate = None
            hr.round_s[g] = time.perf_counter() - began
            if eval_n and not one and k + 1 < len(lengths) and hr.clock.crossed(k, c.eval_every):
                evaluate = k  # every group, once every fragment of this round is applied: its share of the batches
            if k + 1 in hr.pausing.pauses:  # a checkpoint or a join: every average so far is applied, then the groups wait
                await self.pauses.pause(hr, g, k + 1, pending)
                if evaluate is not None:
                    await self.evaluate_outer(hr, g, run, eval_n, evaluate + 1)
                    evaluate = None
            rounds_done = k + 1
        if rounds_done == start:  # joined at the round where the run ends: nothing to send
            return
        last = sync_offsets(lengths[rounds_done - 1], n_frags)
        end = rounds_done
        for f, off in enumerate(last):  # the end: what the last round left unsent goes out, every average is applied
            tail = (lengths[rounds_done - 1] - off) * tokens_per_step
            rounds = sorted(r for _, pf, r in pending if pf == f) + ([end] if tail else [])
            await self.outer.sync(hr, g, f, end, tail, rounds, send=tail > 0, announce=True)
        if eval_n and not one:
            await self.evaluate_outer(hr, g, run, eval_n, end)

    async def inner_step(self, hr: GroupingRun, g: int, run: Run, i: int, data_step: int, lr: float, k: int, *, user_step: int,
                         cap: float = 1.0) -> None:
        """One inner step of group ``g``: the same step for every group (``steps.py``), guards,
        retry, skip, strikes and eviction included. Its record counts in the user's steps
        (``user_step``: where the group is on the run's ``--steps``); one group's also holds the
        evaluation due at its step, and is followed by the checkpoint due there."""
        one = hr.hier is None
        self.outer_guard.evict_if_struck(g)
        done = await self.runner.run(run, user_step if one else data_step, lr, data_step=data_step, group=None if one else g, cap=cap)
        hr.data.read(data_step)
        hr.result.tokens += self.group_batch * self.ctx.task.items_per_row  # a skipped step's batch is spent too
        if done is not None:
            hr.result.losses.append(done.loss)
            elapsed, tokens = self.ctx.trained(hr.elapsed(), hr.result.tokens)
            record = step_record(run, done, step=user_step, lr=lr, tokens=tokens, elapsed=elapsed, compress=self.ctx.cluster.compress, rows=self.group_batch)
            if one:
                await self.evaluate_step(hr, run, record, user_step + 1)
            else:
                record.group, record.round, record.inner_step = g, k, hr.clock.first + i
                record.steps_total = self.ctx.train.steps
            if self.observe is not None:
                await self.observe(run, record, self.group_batch, one)
            self.ctx.step(record)
        if one:  # a skipped step's checkpoint too
            every = self.ctx.cluster.checkpoint_every
            if every and ((user_step + 1) % every == 0 or user_step + 1 == hr.clock.last):
                await self.live.guard(run, self.checkpoints.checkpoint(run, user_step + 1))
        if done is not None:
            self.check_plan(hr, g, run, user_step + 1)

    def check_plan(self, hr: GroupingRun, g: int, run: Run, done: int) -> None:
        """A group whose last 8 steps took far longer than they should (``steps.replan_due``): one
        group raises ``Replan`` at once (its round ends here); of several, every group ends at the
        next round boundary and the run is planned again (``phases.py``)."""
        if hr.clock.end_at is not None:
            return
        why = replan_due(run, self.ctx.cluster, self.replans())
        if why is not None and hr.hier is None:
            if done < hr.clock.last:
                raise Replan(why, done)
        elif why is not None:
            hr.clock.end_at = max(hr.clock.current[x] for x in hr.alive) + 1  # no group has started it yet
            hr.clock.replan_why = f"group {g}'s {why}"
            self.ctx.say(f"re-planning at outer round {hr.clock.end_at}: {hr.clock.replan_why}")

    async def evaluate_step(self, hr: GroupingRun, run: Run, record: StepRecord, done: int) -> None:
        """One group's validation loss into the record of step ``done - 1`` (``--eval-every``, and the grouping's end)."""
        every = self.ctx.cluster.eval_every
        if not every or (done % every and done != hr.clock.last):
            return
        paused = time.perf_counter()
        record.val_loss = await self.live.guard(run, self.checkpoints.evaluate(run, self.ctx.eval_count(), done))
        hr.paused += time.perf_counter() - paused  # elapsed_s and tokens/s count training only
        hr.result.val_losses.append((done - 1, record.val_loss))
        if run.val_metric is not None:
            record.val_metrics[self.ctx.task.metric_name] = run.val_metric
            hr.result.val_metrics.append((done - 1, run.val_metric))

    async def evaluate_outer(self, hr: GroupingRun, g: int, run: Run, eval_n: int, rounds: int) -> None:
        """Group ``g``'s share of the validation batches on the outer weights once ``rounds`` rounds are
        done, in ``run``'s pipeline (``outer_eval.py``); the last share in writes the evaluation, at
        the user's step they reach (``GroupingRun.step_at``)."""
        ev = hr.evals.share(rounds, hr.step_at(rounds), {x: sum(hr.clock.lengths[x]) for x in hr.expected(rounds - 1)}, eval_n)
        first, n = ev.share.get(g, (0, 0))
        if n:  # the clock is not paused: the other groups train meanwhile (elapsed_s of several groups includes evaluation)
            loss = await self.live.guard(run, self.checkpoints.evaluate(run, n, ev.step, outer=True, first=first))
            hr.evals.write(self.ctx, hr.result, hr.elapsed(), [hr.evals.add(rounds, g, Part(n, loss, run.val_metric), hr.alive)])
