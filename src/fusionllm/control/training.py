"""The step clock: one Step call per worker per step, their replies turned into metrics.

A Step names the step and its learning rate (and, with AdaTopK, the byte target of each of the
worker's outgoing links); the workers read their own batches. Only a worker that cannot read the
run's data gets its micro-batches in the call.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from typing import Any

import numpy as np

from fusionllm.compress.wire import encode_array
from fusionllm.core.config import TrainResult, lr_at
from fusionllm.core.errors import FusionError
from fusionllm.core.metrics import JsonlWriter
from fusionllm.schedule.actions import format_grid
from fusionllm.schedule.plan import routes
from fusionllm.transport.control import Step, StepDone

from .config import Replan, Run


class TrainingMixin:
    """The coordinator's training half (``Coordinator`` mixes it in)."""

    def _inputs_for(self, run: Run, w: int, *arrays: np.ndarray) -> dict[str, dict[str, bytes]]:
        """The rows of a batch's arrays (tokens and targets for a language model) that worker ``w``'s
        micro-batches read, for a worker fed by the coordinator."""
        r = routes(run.graph, run.plan)
        stage = run.plan.stage_of_worker(w).index
        size = arrays[0].shape[0] // run.plan.micro_batches
        edges = [(n.outputs[0].id, data) for n, data in zip(run.graph.input_nodes, arrays, strict=False)]
        return {str(mb): {e: encode_array(np.ascontiguousarray(d[mb * size : (mb + 1) * size])) for e, d in edges if stage in r.consumers.get(e, [])}
                for mb in run.plan.mbs_of(w)}

    async def _call_step(self, run: Run, w: int, msg: Step) -> StepDone:
        """One worker's step. A call broken by a dropped link is made again within the step's deadline
        (the worker answers a repeated Step with the same run); a dead worker is found meanwhile by its
        refused connection or its stale heartbeat (``_step_calls``)."""
        c = self.cluster
        return StepDone.from_wire(await run.clients[w].call_retrying("Step", msg.to_wire(), within=c.step_timeout, timeout=c.step_timeout))

    async def _train(self, run: Run, metrics: JsonlWriter) -> TrainResult:
        t, c = self.train, self.cluster
        eval_n = self.task.eval_count(c.eval_batches) if c.eval_every else 0
        if c.eval_every and eval_n == 0:
            raise FusionError(f"the validation split holds no whole batch of {t.batch_size} x {t.seq_len} tokens: use --eval-every 0 or more data")
        result = TrainResult(num_params=run.graph.num_params())
        started = time.perf_counter()
        self._recent: deque[float] = deque(maxlen=8)
        self._links: dict[tuple[int, int], tuple[int, float]] = {}
        step, attempt = self.start_step, 0
        while step < t.steps:
            self._stop_if_asked(step)  # Ctrl+C or SIGTERM: stop here, between two steps (restart.py)
            lr = lr_at(step, lr=t.lr, steps=t.steps, warmup=t.warmup)
            batch = self.task.batch(step) if run.fed else None
            calls = {}
            for w in run.plan.workers:
                ratios = ratios_of(self.policy, w)
                inputs = self._inputs_for(run, w, *batch) if batch is not None and w in run.fed else None
                calls[w] = self._call_step(run, w, Step(step, lr, inputs, ratios, attempt=attempt))
            replies: dict[int, StepDone] = await self._step_calls(run, calls)
            if any(rep.failed is not None or rep.aborted for rep in replies.values()):
                await self._raise_if_lost(run, "a step failed")
            self._check_failures(run, step, replies)
            if any(rep.skipped or rep.bad for rep in replies.values()):  # a bad tensor: no worker applied this step
                attempt = self._bad_step(run, step, attempt, replies, metrics)
                if attempt < 0:
                    step, attempt = step + 1, 0
                continue
            attempt = 0
            losses = {int(mb): v for rep in replies.values() for mb, v in rep.losses.items()}
            if len(losses) != run.plan.micro_batches:
                raise FusionError(f"step {step}: got losses of micro-batches {sorted(losses)}, expected {run.plan.micro_batches}")
            loss = sum(losses[m] for m in sorted(losses)) / len(losses)
            result.losses.append(loss)
            result.tokens = (step + 1 - self.start_step) * t.batch_size * self.task.items_per_row
            elapsed = time.perf_counter() - started
            record: dict[str, Any] = {
                "step": step, "loss": loss, "tokens": result.tokens, "elapsed_s": round(elapsed, 4),
                "tokens_per_s": round(result.tokens / max(elapsed, 1e-9), 1), "lr": lr,
                "grad_norm": next(iter(replies.values())).grad_norm,
                "step_s": round(max(rep.seconds for rep in replies.values()), 4),
                "bytes": self._link_bytes(run, replies), "cpu_s": {str(w): rep.cpu_s for w, rep in replies.items()},
                "rss": {str(w): [rep.rss_base, rep.rss_peak] for w, rep in replies.items()},
            }
            if any(rep.carried_to for rep in replies.values()):  # activations and gradients through a world (runtime/carrier.py)
                record["carried_bytes"] = self._link_bytes(run, replies, carried=True)
            if "predicted_step_s" in run.plan.meta:
                record["predicted_step_s"] = round(run.plan.meta["predicted_step_s"], 4)
            if c.compress != "none":
                record["compress"] = c.compress
            self._observe_links(step, replies, record)
            if c.eval_every and ((step + 1) % c.eval_every == 0 or step + 1 == t.steps):
                paused = time.perf_counter()
                record["val_loss"] = await self._guard(run, self._evaluate(run, eval_n, step + 1))
                result.val_losses.append((step, record["val_loss"]))
                if run.val_metric is not None:
                    record[f"val_{self.task.metric_name}"] = run.val_metric
                    result.val_metrics.append((step, run.val_metric))
                started += time.perf_counter() - paused  # elapsed_s and tokens/s count training only
            metrics.write(record)
            self.status.step(record)
            self.on_step(record)
            done = step + 1
            if c.checkpoint_every and (done % c.checkpoint_every == 0 or done == t.steps):
                await self._guard(run, self._checkpoint(run, done))
            self._recent.append(record["step_s"])
            if done < t.steps:
                self._check_plan(run, done)
            step += 1
        result.elapsed_s = time.perf_counter() - started
        return result

    def _observe_links(self, step: int, replies: dict[int, StepDone], record: dict[str, Any]) -> None:
        """Link measurements: kept for a re-plan, and fed to AdaTopK's policy."""
        for w, rep in replies.items():  # a world's transfers too: a re-plan must see a choked link it carried
            for dst, (nbytes, busy, *_) in [*rep.link_stats.items(), *rep.world_stats.items()]:
                got, took = self._links.get((w, int(dst)), (0, 0.0))
                self._links[(w, int(dst))] = (got + int(nbytes), took + busy)
        if self.policy is not None:
            observe_policy(self.policy, replies, record, learn=step > self.start_step)  # the first step's sends also open the connections

    # ---- a plan gone wrong -------------------------------------------------------------------------
    def _check_plan(self, run: Run, done: int) -> None:
        """Raise Replan when the last 8 steps took far longer than the plan's prediction."""
        c = self.cluster
        predicted = run.plan.meta.get("predicted_step_s")
        if not (c.scheduler and c.replan_factor > 0 and predicted and len(self._recent) == self._recent.maxlen):
            return
        if self.replans >= c.max_replans:
            return
        median = statistics.median(self._recent)
        if median > c.replan_factor * predicted:
            raise Replan(f"steps take {median:.2f} s, the plan predicted {predicted:.2f} s", done)

    def _measured_links(self) -> dict[tuple[int, int], float]:
        """Bits/s of the links that carried enough traffic lately to judge (bytes over busy time)."""
        return {link: got * 8 / took for link, (got, took) in self._links.items() if got >= 256 << 10 and took > 0}

    async def _step_calls(self, run: Run, calls: dict[int, Any]) -> dict[int, Any]:
        """Every worker's reply, watching heartbeats meanwhile: a dead or hung worker is lost
        within dead_after_s (killed processes at once: their calls fail)."""
        tasks = {w: asyncio.create_task(call) for w, call in calls.items()}
        aborting: asyncio.Future | None = None
        try:
            while True:
                _, pending = await asyncio.wait(tasks.values(), timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                errors = [t.exception() for t in tasks.values() if t.done() and not t.cancelled() and t.exception() is not None]
                if errors:
                    await self._raise_if_lost(run, str(errors[0]))
                    raise errors[0]  # type: ignore[misc]
                if not pending:
                    return {w: t.result() for w, t in tasks.items()}
                failed = [w for w, t in tasks.items() if t.done() and getattr(t.result(), "failed", None) is not None]
                if failed and aborting is None:  # the others would wait for its tensors until the step timeout: abort them now
                    waiting = [w for w, t in tasks.items() if not t.done()]
                    aborting = asyncio.gather(*(run.clients[w].call("Abort", {}, timeout=10) for w in waiting), return_exceptions=True)
                self._raise_if_stale(run)
        finally:
            for t in tasks.values():
                t.cancel()
            if aborting is not None:
                await aborting

    def _link_bytes(self, run: Run, replies: dict[int, StepDone], *, carried: bool = False) -> dict[str, int]:
        """Bytes per link this step: the data plane's, or (``carried``) those a world carried point to point."""
        out = {}
        for w, rep in replies.items():
            for dst, total in (rep.carried_to if carried else rep.bytes_to).items():
                link = f"w{w}->w{dst}"
                seen = ("carried " if carried else "") + link
                out[link] = total - run.bytes_before.get(seen, 0)
                run.bytes_before[seen] = total
        return out

    def _check_failures(self, run: Run, step: int, replies: dict[int, StepDone]) -> None:
        failed = [(w, rep.failed) for w, rep in replies.items() if rep.failed is not None]
        if not failed:
            return
        # the first failure in time is usually the cause; others are workers left waiting
        w, info = min(failed, key=lambda f: ("Timeout" in f[1].error, f[0]))
        grid = format_grid({f"worker {k}": v for k, v in sorted(run.actions.items())}, (f"worker {w}", info.index))
        raise FusionError(f"step {step} failed on worker {w} at {info.action}: {info.error}\naction grid (the failing action is marked !):\n{grid}")


def ratios_of(policy: Any, worker: int) -> dict[str, float] | None:
    """What a Step tells ``worker`` about its links' AdaTopK ratios (None: no policy)."""
    return {str(b): r for (a, b), r in policy.ratios().items() if a == worker} if policy is not None else None


def observe_policy(policy: Any, replies: dict[int, StepDone], record: dict[str, Any], *, learn: bool) -> None:
    """AdaTopK's policy sees the links' measured bytes and busy time (``learn``); the step record gets
    the ratios in force and the fitted links."""
    record["ratios"] = {f"w{a}->w{b}": round(r, 5) for (a, b), r in policy.ratios().items()}
    if learn:
        for w, rep in replies.items():
            for dst, (nbytes, busy, *messages) in rep.link_stats.items():
                policy.observe((w, int(dst)), nbytes, busy, messages[0] if messages else 1)
                record.setdefault("link_stats", {})[f"w{w}->w{dst}"] = [int(nbytes), round(busy, 5), *(int(m) for m in messages)]
    record["link_fit"] = {f"w{a}->w{b}": [round(policy.bps[(a, b)]), round(policy.fixed_s.get((a, b), 0.0), 5)]
                          for (a, b) in policy.loads if (a, b) in policy.bps}
