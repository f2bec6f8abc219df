"""The step clock of a synchronous run (one group): steps, evaluations, checkpoints, plan checks.

Each step is one call of ``StepRunner.run`` (``steps.py``), the same as a group's inner step in a
hierarchical run: the workers read their own batches; only a worker that cannot read the run's data
gets its micro-batches in the call. Between two steps the loop evaluates (``--eval-every``, in the
pipeline), writes checkpoints (``--checkpoint-every``), stops when asked (``restart.py``), and
raises ``Replan`` when the steps take far longer than the plan predicted.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from fusionllm.compress.budget import budget_cap
from fusionllm.core.config import TrainResult, lr_at
from fusionllm.core.errors import FusionError

from .config import Replan, Run
from .context import RunContext
from .rounds import DataOffsets, RoundClock
from .state import Checkpoints
from .steps import StepRunner, replan_due, step_record
from .workers import Liveness


class SyncLoop:
    """Steps ``clock.start_step`` .. ``--steps`` of one plan; returns at the end or raises for a new plan."""

    def __init__(self, ctx: RunContext, runner: StepRunner, checkpoints: Checkpoints, live: Liveness,
                 stop_if_asked: Callable[[int], None], replans: Callable[[], int]) -> None:
        """``stop_if_asked(done)`` raises between two steps once a stop was asked; ``replans()``: how
        many re-plans the run made so far (``--max-replans``)."""
        self.ctx, self.runner, self.checkpoints, self.live = ctx, runner, checkpoints, live
        self.stop_if_asked, self.replans = stop_if_asked, replans

    async def train(self, run: Run, *, end: int | None = None, data_offset: int = 0) -> TrainResult:
        """Steps from the clock's start to ``end`` (default ``--steps``: a regroup ends a grouping
        earlier); step ``s`` reads batch ``s + data_offset`` (after groups, which read batches of
        their own)."""
        ctx = self.ctx
        t, c, start = ctx.train, ctx.cluster, ctx.clock.start_step
        end = t.steps if end is None else end
        eval_n = ctx.eval_count()
        if c.eval_every and eval_n == 0:
            raise FusionError(f"the validation split holds no whole batch of {t.batch_size} x {t.seq_len} tokens: use --eval-every 0 or more data")
        result = TrainResult(num_params=run.graph.num_params())
        ctx.segment()
        started = time.perf_counter()
        # one group's rounds are one step each: the groups' clock and data offsets, with one group
        clock, data = RoundClock(start, end, {0: [1] * (end - start)}), DataOffsets(start + data_offset, 1, next=start + data_offset)
        for i in range(end - start):
            step = clock.user_step(0, i)
            self.stop_if_asked(step)  # Ctrl+C or SIGTERM: stop here, between two steps (restart.py)
            lr = lr_at(step, lr=t.lr, steps=t.steps, warmup=t.warmup)
            done = await self.runner.run(run, step, lr, data_step=data.batch(0, i), cap=budget_cap(step, t.steps))
            step += 1
            if done is None:  # skipped: no worker applied it, its batch is not used again (a checkpoint due here is still written)
                await self.checkpoint_if_due(run, step, end)
                continue
            result.losses.append(done.loss)
            result.tokens = (step - start) * t.batch_size * ctx.task.items_per_row
            elapsed, tokens = ctx.trained(time.perf_counter() - started, result.tokens)
            record = step_record(run, done, step=step - 1, lr=lr, tokens=tokens, elapsed=elapsed, compress=c.compress, rows=t.batch_size)
            if c.eval_every and (step % c.eval_every == 0 or step == end):
                paused = time.perf_counter()
                record.val_loss = await self.live.guard(run, self.checkpoints.evaluate(run, eval_n, step))
                result.val_losses.append((step - 1, record.val_loss))
                if run.val_metric is not None:
                    record.val_metrics[ctx.task.metric_name] = run.val_metric
                    result.val_metrics.append((step - 1, run.val_metric))
                started += time.perf_counter() - paused  # elapsed_s and tokens/s count training only
            ctx.step(record)
            await self.checkpoint_if_due(run, step, end)
            if step < end:
                self.check_plan(run, step)
        result.elapsed_s = time.perf_counter() - started
        return result

    async def checkpoint_if_due(self, run: Run, done: int, end: int) -> None:
        every = self.ctx.cluster.checkpoint_every
        if every and (done % every == 0 or done == end):
            await self.live.guard(run, self.checkpoints.checkpoint(run, done))

    def check_plan(self, run: Run, done: int) -> None:
        """Raise Replan when the last 8 steps took far longer than they should (``steps.replan_due``)."""
        why = replan_due(run, self.ctx.cluster, self.replans())
        if why is not None:
            raise Replan(why, done)
