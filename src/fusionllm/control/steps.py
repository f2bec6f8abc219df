"""One step of one group, the same for every group: calls, guards, retry, skip, strikes, the record.

A synchronous run is one group and calls this for each of its steps; a hierarchical run calls it
for each inner step of each group. Either way:

- every worker of the group's plan gets a ``Step`` (its learning rate, its AdaTopK byte targets,
  and, only for a worker that cannot read the run's data, its micro-batches);
- a worker that died or hung raises ``WorkerLost`` (``workers.py``), a failed action a
  ``FusionError`` with the action grid;
- a step that a numeric guard refused is judged by the one bad-step rule (``bad_steps.py``): run
  once more, then skipped; a worker blamed ``--evict-after`` times raises ``Evict``;
- a good step gives one step record, built here for every group (``step_record``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

from fusionllm.compress.wire import encode_array
from fusionllm.core.errors import FusionError
from fusionllm.core.metrics import StepRecord
from fusionllm.planning.adatopk import sender_budgets
from fusionllm.schedule.actions import format_grid
from fusionllm.schedule.plan import routes
from fusionllm.transport.control import Step, StepDone

from .bad_steps import Strikes
from .config import ClusterConfig, Run
from .task import RunTask
from .workers import Liveness


@dataclass(frozen=True)
class StepDoneAll:
    """A step every worker applied: their replies and the mean loss of the micro-batches."""

    replies: dict[int, StepDone]
    loss: float


class StepRunner:
    """Runs one step of one group to its end: applied (``StepDoneAll``) or skipped (``None``)."""

    def __init__(self, task: RunTask, live: Liveness, strikes: Strikes) -> None:
        self.task, self.live, self.strikes = task, live, strikes

    async def run(self, run: Run, step: int, lr: float, *, data_step: int | None = None, group: int | None = None,
                  cap: float = 1.0) -> StepDoneAll | None:
        """Step ``step`` of ``run``'s plan on batch ``data_step`` (default ``step``), attempts included;
        ``cap``: the most relative error AdaTopK's codecs may add this step (``compress/budget.budget_cap``)."""
        attempt, trust = 0, False
        while True:
            replies = await self.attempt(run, step if data_step is None else data_step, lr, attempt, trust_norms=trust, cap=cap)
            if not any(rep.skipped or rep.bad for rep in replies.values()):
                return StepDoneAll(replies, mean_loss(run, step, replies))
            attempt = self.strikes.judge(step, attempt, replies, group=group)  # raises Evict, or FusionError (stop)
            if attempt < 0:
                return None
            trust = self.strikes.data_spike(step, group)  # the same finite norms twice: the data, run once more trusting them

    async def attempt(self, run: Run, data_step: int, lr: float, attempt: int, *, trust_norms: bool = False,
                      cap: float = 1.0) -> dict[int, StepDone]:
        """One attempt: every worker's reply (a failed or lost worker raises)."""
        batch = self.task.batch(data_step) if run.fed else None
        calls = {}
        for w in run.plan.workers:
            inputs = inputs_for(run, w, *batch) if batch is not None and w in run.fed else None
            targets, share, most = sender_budgets(run.plan, run.policy, w, cap)  # AdaTopK's decision for this worker's links
            calls[w] = self.live.call_step(run, w, Step(data_step, lr, inputs, targets, attempt=attempt, budget_scale=share,
                                                        budget_cap=most, trust_norms=trust_norms))
        replies: dict[int, StepDone] = await self.live.calls(run, calls)
        if any(rep.failed is not None or rep.aborted for rep in replies.values()):
            await self.live.raise_if_lost(run, "a step failed")
        check_failures(run, data_step, replies)
        return replies


def mean_loss(run: Run, step: int, replies: dict[int, StepDone]) -> float:
    losses = {int(mb): v for rep in replies.values() for mb, v in rep.losses.items()}
    if len(losses) != run.plan.micro_batches:
        raise FusionError(f"step {step}: got losses of micro-batches {sorted(losses)}, expected {run.plan.micro_batches}")
    return sum(losses[m] for m in sorted(losses)) / len(losses)


def check_failures(run: Run, step: int, replies: dict[int, StepDone]) -> None:
    """A worker's failed action: an error with the action grid, the failing cell marked."""
    failed = [(w, rep.failed) for w, rep in replies.items() if rep.failed is not None]
    if not failed:
        return
    # the first failure in time is usually the cause; others are workers left waiting
    w, info = min(failed, key=lambda f: ("Timeout" in f[1].error, f[0]))
    grid = format_grid({f"worker {k}": v for k, v in sorted(run.actions.items())}, (f"worker {w}", info.index))
    raise FusionError(f"step {step} failed on worker {w} at {info.action}: {info.error}\naction grid (the failing action is marked !):\n{grid}")


BASELINE_AFTER = 10  # a plan's settled step time: the median of its steps 3-10 (the first open connections, warm caches)
MISPREDICTED = 2.0  # slower than the prediction by this times --replan-factor from the start: planned again


def inputs_for(run: Run, w: int, *arrays: np.ndarray) -> dict[str, dict[str, bytes]]:
    """The rows of a batch's arrays (tokens and targets for a language model) that worker ``w``'s
    micro-batches read, for a worker fed by the coordinator."""
    r = routes(run.graph, run.plan)
    stage = run.plan.stage_of_worker(w).index
    size = arrays[0].shape[0] // run.plan.micro_batches
    edges = [(n.outputs[0].id, data) for n, data in zip(run.graph.input_nodes, arrays, strict=False)]
    return {str(mb): {e: encode_array(np.ascontiguousarray(d[mb * size : (mb + 1) * size])) for e, d in edges if stage in r.consumers.get(e, [])}
            for mb in run.plan.mbs_of(w)}


def step_record(run: Run, done: StepDoneAll, *, step: int, lr: float, tokens: int, elapsed: float, compress: str, rows: int = 0) -> StepRecord:
    """The step record, the same for every group (a group's run sets group, round, inner_step).
    Observes the links on the way: bytes and busy time for a re-plan, and the AdaTopK policy."""
    replies = done.replies
    record = StepRecord(
        step=step, loss=done.loss, tokens=tokens, elapsed_s=round(elapsed, 4), tokens_per_s=round(tokens / max(elapsed, 1e-9), 1), lr=lr,
        grad_norm=next(iter(replies.values())).grad_norm, step_s=round(max(rep.seconds for rep in replies.values()), 4),
        bytes=link_bytes(run, replies), cpu_s={str(w): rep.cpu_s for w, rep in replies.items()},
        rss={str(w): [rep.rss_base, rep.rss_peak] for w, rep in replies.items()},
    )
    if any(rep.carried_to for rep in replies.values()):  # activations and gradients through a world (runtime/dist/carrier.py)
        record.carried_bytes = link_bytes(run, replies, carried=True)
    noise = noise_scale(run, replies, rows)
    if noise is not None:
        record.noise_scale = float(f"{noise:.4g}")
    if "predicted_step_s" in run.plan.meta:
        record.predicted_step_s = round(run.plan.meta["predicted_step_s"], 4)
    if compress != "none":
        record.compress = compress
    observe_links(run, replies, record)
    run.recent.append(record.step_s)
    run.steps_seen += 1
    if run.steps_seen == BASELINE_AFTER:
        run.baseline_s = statistics.median(run.recent)
    return record


def slower_than_planned(run: Run, factor: float) -> str | None:
    """Why the plan in force should be made again, or None: its last 8 steps took ``factor`` times
    its own settled step time (a link or device slowed down since it started), or ``MISPREDICTED``
    times ``factor`` the prediction (a plan wrong from the start, such as a link far slower than
    its file said). A plan that is merely slower than predicted from its start is kept: planned
    again with the same cost model it would be as wrong, and re-plans cost time (on the testbed
    they made runs 35% slower to a target: docs/scheduler.md)."""
    predicted = run.plan.meta.get("predicted_step_s")
    if not predicted or factor <= 0 or run.baseline_s is None or len(run.recent) < (run.recent.maxlen or 0):
        return None
    median = statistics.median(run.recent)
    if median > factor * run.baseline_s:
        return f"steps take {median:.2f} s, {run.baseline_s:.2f} s when the plan settled (predicted {predicted:.2f} s)"
    if median > MISPREDICTED * factor * predicted:
        return f"steps take {median:.2f} s, the plan predicted {predicted:.2f} s"
    return None


def replan_due(run: Run, cluster: ClusterConfig, replans: int) -> str | None:
    """The one re-plan rule of every group, whatever the grouping: why ``run``'s plan should be made
    again (``slower_than_planned``), or None; never without a planner (``--scheduler``) or past
    ``--max-replans``. A grouping of one group re-plans at once; of several, every group ends at
    the next round boundary first (``hierarchical.py``)."""
    if not cluster.scheduler or replans >= cluster.max_replans:
        return None
    return slower_than_planned(run, cluster.replan_factor)


def noise_scale(run: Run, replies: dict[int, StepDone], rows: int) -> float | None:
    """The run's gradient noise scale in rows, with this step's accumulated norms taken in, when every
    worker of the plan measured them (one worker per stage: planning/noise_scale.py); else the estimate so far."""
    m = run.plan.micro_batches
    sq = [rep.accum_sq for rep in replies.values()]
    if m < 2 or not rows or not sq or any(len(s) != m for s in sq):
        return run.noise.rows(rows // m) if rows and m else None
    return run.noise.update([sum(col) for col in zip(*sq, strict=True)], rows // m)


def link_bytes(run: Run, replies: dict[int, StepDone], *, carried: bool = False) -> dict[str, int]:
    """Bytes per link this step: the data plane's, or (``carried``) those a world carried point to point."""
    out = {}
    for w, rep in replies.items():
        for dst, total in (rep.carried_to if carried else rep.bytes_to).items():
            link = f"w{w}->w{dst}"
            seen = ("carried " if carried else "") + link
            out[link] = total - run.bytes_before.get(seen, 0)
            run.bytes_before[seen] = total
    return out


def observe_links(run: Run, replies: dict[int, StepDone], record: StepRecord) -> None:
    """Link measurements: kept for a re-plan (``run.links``), and fed to the plan's AdaTopK policy,
    whose ratios in force and fitted links go into the record."""
    for w, rep in replies.items():  # a world's transfers too: a re-plan must see a choked link it carried
        for dst, (nbytes, busy, *_) in [*rep.link_stats.items(), *rep.world_stats.items()]:
            got, took = run.links.get((w, int(dst)), (0, 0.0))
            run.links[(w, int(dst))] = (got + int(nbytes), took + busy)
    policy = run.policy
    if policy is None:
        return
    record.ratios = {f"w{a}->w{b}": round(r, 5) for (a, b), r in policy.ratios().items()}
    if run.observed:  # the first step's sends also open the connections: not learnt from
        stats: dict[str, list[float]] = {}
        for w, rep in replies.items():
            for dst, (nbytes, busy, *messages) in rep.link_stats.items():
                policy.observe((w, int(dst)), nbytes, busy, messages[0] if messages else 1)
                stats[f"w{w}->w{dst}"] = [int(nbytes), round(busy, 5), *(int(m) for m in messages)]
        record.link_stats = stats or None
    codecs = {f"w{w}->w{dst}": dict(roles) for w, rep in replies.items() for dst, roles in rep.codecs.items()}
    record.codecs = codecs or None
    run.observed = True
    record.link_fit = {f"w{a}->w{b}": [round(policy.bps[(a, b)]), round(policy.fixed_s.get((a, b), 0.0), 5)]
                          for (a, b) in policy.loads if (a, b) in policy.bps}


def measured_links(run: Run) -> dict[tuple[int, int], float]:
    """Bits/s of the links that carried enough traffic lately to judge (bytes over busy time)."""
    return {link: got * 8 / took for link, (got, took) in run.links.items() if got >= 256 << 10 and took > 0}
