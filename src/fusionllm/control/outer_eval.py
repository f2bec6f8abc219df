"""Evaluations of the outer weights, shared by every group of a grouping.

Once the averages of rounds ``0 .. k`` are applied (and none of a later round: a later round's first
fragment is due after round ``k``'s last, ``hierarchical.py``), every group holds the same outer
weights. So each group evaluates a share of the validation batches (``shares``: in proportion to
its inner steps per round, which the planner sets in proportion to its speed), and the last share
in writes the evaluation (``OuterEvals``): the same batches, weights and loss as one group
evaluating them all, up to the order of a float sum.

One group evaluating every batch kept the others waiting at the next outer sync, and it was the
lowest-numbered group, often the slowest: on ``random:41`` (issue 58) the group of two 0.29-core
devices evaluated 16 batches every 10 steps while the 0.74-core group idled; that device was busy
54% of the run.

A group that leaves the run before evaluating its share: the evaluation is written from the shares
that came in (its ``batches`` say how many), once every other group has sent its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fusionllm.core.config import TrainResult

    from .context import RunContext


def shares(weights: Mapping[int, float], batches: int) -> dict[int, tuple[int, int]]:
    """Each group's ``(first batch, batches)`` of ``batches``, in proportion to ``weights`` (largest
    remainders; ties to the lower group), consecutive in group order; a group may get none."""
    groups = sorted(weights)
    total = sum(max(0.0, weights[g]) for g in groups)
    if not groups or batches <= 0:
        return {g: (0, 0) for g in groups}
    exact = {g: batches * (max(0.0, weights[g]) / total if total > 0 else 1.0 / len(groups)) for g in groups}
    count = {g: int(exact[g]) for g in groups}
    for g in sorted(groups, key=lambda g: (-(exact[g] - count[g]), g))[: batches - sum(count.values())]:
        count[g] += 1
    out, at = {}, 0
    for g in groups:
        out[g] = (at, count[g])
        at += count[g]
    return out


@dataclass
class Part:
    """One group's share of an evaluation: its mean loss over ``batches`` batches, and its metric's."""

    batches: int
    loss: float
    metric: float | None = None


@dataclass
class Evaluation:
    """An evaluation being gathered: after ``rounds`` rounds, at the user's ``step``; its shares and the parts in."""

    rounds: int
    step: int
    share: dict[int, tuple[int, int]]
    parts: dict[int, Part] = field(default_factory=dict)

    def ready(self, alive: set[int]) -> bool:
        """Every share is in, or its group left the run (with one part in at least)."""
        waiting = [g for g, (_, n) in self.share.items() if n and g not in self.parts]
        return bool(self.parts) and all(g not in alive for g in waiting)

    def combined(self) -> tuple[float, float | None, int]:
        """The mean loss over every batch in (each part weighted by its batches), the metric's where
        every part has one, and the batches."""
        n = sum(p.batches for p in self.parts.values())
        loss = sum(p.loss * p.batches for p in self.parts.values()) / n
        metrics = [p for p in self.parts.values() if p.metric is not None]
        metric = sum((p.metric or 0.0) * p.batches for p in metrics) / n if len(metrics) == len(self.parts) else None
        return loss, metric, n

    def record(self, tokens: int, elapsed_s: float, metric_name: str) -> dict[str, Any]:
        """Its ``eval`` event."""
        loss, metric, n = self.combined()
        out: dict[str, Any] = {"event": "eval", "step": self.step, "round": self.rounds, "val_loss": loss, "tokens": tokens,
                               "elapsed_s": round(elapsed_s, 4), "batches": n, "groups": sorted(self.parts)}
        if metric is not None:
            out[f"val_{metric_name}"] = metric
        return out


class OuterEvals:
    """The evaluations of a grouping not written yet, by the rounds they follow."""

    def __init__(self) -> None:
        self.pending: dict[int, Evaluation] = {}

    def share(self, rounds: int, step: int, weights: Mapping[int, float], batches: int) -> Evaluation:
        """The evaluation after ``rounds`` rounds: its shares are set by the first group to get there
        (``weights``: the groups that take part then), and kept for the others."""
        if rounds not in self.pending:
            self.pending[rounds] = Evaluation(rounds, step, shares(weights, batches))
        return self.pending[rounds]

    def add(self, rounds: int, g: int, part: Part, alive: set[int]) -> Evaluation | None:
        """Group ``g``'s part in; the evaluation once it is ready to write (then no longer pending)."""
        self.pending[rounds].parts[g] = part
        return self.take(rounds, alive)

    def left(self, alive: set[int]) -> list[Evaluation]:
        """A group left the run: the evaluations that waited on it alone, ready to write."""
        return [ev for r in sorted(self.pending) if (ev := self.take(r, alive)) is not None]

    def take(self, rounds: int, alive: set[int]) -> Evaluation | None:
        ev = self.pending.get(rounds)
        if ev is None or not ev.ready(alive):
            return None
        del self.pending[rounds]
        return ev

    def write(self, ctx: RunContext, result: TrainResult, clock: float, done: list[Evaluation | None]) -> None:
        """Evaluations whose shares are all in (or whose missing groups left): into the run's result
        and its events, with the run's clock (``clock``, seconds) and tokens as they are now."""
        for ev in filter(None, done):
            elapsed, tokens = ctx.trained(clock, result.tokens)
            record = ev.record(tokens, elapsed, ctx.task.metric_name)
            result.val_losses.append((ev.step, record["val_loss"]))
            if f"val_{ctx.task.metric_name}" in record:
                result.val_metrics.append((ev.step, record[f"val_{ctx.task.metric_name}"]))
            ctx.event(record)
